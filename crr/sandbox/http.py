"""HTTP record/replay (paper: Appendix "Determinism Filter and Network Replay", HTTP replay layer).

For a task with an environment (crr.sandbox.mirror), every pytest session in its sandboxes runs
inside one vcrpy cassette: crr/sandbox/http_plugin.py, installed into the environment as
`crr_http_replay` and loaded through PYTEST_PLUGINS.

  record  only in the determinism filter's recording run: the gold patch in the one kind of
          sandbox that has network (an engine made with `record_http=True`); every outbound request
          and its response go to the cassette, which the filter keeps with the admitted task;
  replay  everywhere else, with no network: requests are answered from the task's cassette,
          matched on method, URL and normalised body. A request with no recording raises inside the
          test and is logged to MISSES; the filter then excludes the task (a task-level error).

vcrpy rather than a proxy: it patches http.client, urllib3, requests, httpx and aiohttp inside the
test process, so replay needs no path out of the sandbox's network namespace at all, and the same
plugin works on both engines.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from crr.errors import CRRError
from crr.sandbox.base import SCRATCH_DIR, Sandbox

PLUGIN_SOURCE = Path(__file__).with_name("http_plugin.py")
PLUGIN_MODULE = "crr_http_replay"
# Inside .git: never part of a model patch or a tree digest.
CASSETTE = f"{SCRATCH_DIR}/http/cassette.yaml"
MISSES = f"{SCRATCH_DIR}/http/misses.jsonl"


@dataclass(frozen=True)
class Traffic:
    """What a sandbox's test runs did on HTTP: the cassette it recorded, the requests it missed."""

    cassette: bytes | None = None
    misses: list[dict] = field(default_factory=list)


def sandbox_env(repo_dir: str, record: bool) -> dict[str, str]:
    return {"PYTEST_PLUGINS": PLUGIN_MODULE, "CRR_HTTP_MODE": "record" if record else "replay",
            "CRR_HTTP_CASSETTE": f"{repo_dir}/{CASSETTE}", "CRR_HTTP_MISSES": f"{repo_dir}/{MISSES}"}


def install_cassette(sandbox: Sandbox, record_http: bool = False) -> Sandbox:
    """Put the task's recorded cassette where the replaying plugin reads it, in a fresh sandbox of a task
    with an environment (a restored one has it in its snapshot; a recording one records instead). A task
    without one replays an empty cassette. The sandbox is closed if this fails."""
    replay = sandbox.task.http_replay
    if replay and sandbox.task.mirror and not record_http:
        try:
            sandbox.write_file(CASSETTE, read_cassette(replay))
        except BaseException:
            sandbox.close()
            raise
    return sandbox


def read_cassette(replay: dict) -> bytes:
    path = Path(replay["cassette"])
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CRRError(f"cannot read the HTTP cassette {path}: {e.strerror}; it is recorded by "
                       "`crr filter-tasks --record-http` next to admitted.jsonl") from None
    if hashlib.sha256(data).hexdigest() != replay["sha256"]:
        raise CRRError(f"the HTTP cassette {path} does not match the sha256 in its task row; it was "
                       "changed after recording: re-run `crr filter-tasks --record-http`")
    return data


def collect(sandbox: Sandbox, recording: bool) -> Traffic:
    """The cassette a `recording` sandbox wrote (None when nothing was requested), or the requests a
    replaying one had no recording for."""
    cassette = _read(sandbox, CASSETTE) if recording else None
    text = (_read(sandbox, MISSES) or b"").decode("utf-8", errors="replace")
    misses = [json.loads(line) for line in text.splitlines() if line.strip()]
    return Traffic(cassette=cassette, misses=misses)


def _read(sandbox: Sandbox, path: str) -> bytes | None:
    try:
        return sandbox.read_file(path)
    except CRRError:
        return None  # not written: nothing recorded, nothing missed
