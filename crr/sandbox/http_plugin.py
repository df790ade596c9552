"""crr's HTTP record/replay inside a sandbox: a pytest plugin (the host side is crr.sandbox.http).

Installed into every task environment as `crr_http_replay` and loaded through PYTEST_PLUGINS; it
imports only vcrpy and the standard library, never crr. CRR_HTTP_MODE=record|replay picks the mode,
CRR_HTTP_CASSETTE the cassette and CRR_HTTP_MISSES the log of requests replay had no recording for.
"""

import json
import os

import vcr
import vcr.errors

_cassette = None


def _log_misses(init):
    """vcrpy raises CannotOverwriteExistingCassetteException for a request it has no recording of,
    and only then; logging at its construction catches misses even where the code under test
    swallows the exception."""

    def logged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        request = kwargs.get("failed_request")
        if request is not None and os.environ.get("CRR_HTTP_MISSES"):
            with open(os.environ["CRR_HTTP_MISSES"], "a", encoding="utf-8") as f:
                f.write(json.dumps({"method": request.method, "uri": request.uri}) + "\n")

    return logged


def pytest_configure(config):
    global _cassette
    mode = os.environ.get("CRR_HTTP_MODE")
    if mode not in ("record", "replay") or _cassette is not None:
        return
    path = os.environ["CRR_HTTP_CASSETTE"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    error = vcr.errors.CannotOverwriteExistingCassetteException
    error.__init__ = _log_misses(error.__init__)
    # vcrpy's `body` matcher compares bodies normalised (JSON and form fields parsed, chunking
    # undone): the paper's "normalised body digest".
    recorder = vcr.VCR(record_mode="all" if mode == "record" else "none", match_on=("method", "uri", "body"))
    _cassette = recorder.use_cassette(path, allow_playback_repeats=True)
    _cassette.__enter__()


def pytest_unconfigure(config):
    global _cassette
    if _cassette is not None:
        _cassette.__exit__(None, None, None)  # record mode: saves the cassette
        _cassette = None
