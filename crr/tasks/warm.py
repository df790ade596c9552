"""A warm pytest worker for task generation: each run in a fork of a process that has imported pytest.

The micro generator runs pytest twice per candidate (before and after the gold patch) in a throw-away
repository; a fresh `python -m pytest` spends most of its time starting the interpreter and importing
pytest. Here one long-lived worker, started with the pinned environment (hash seed, plugin path), imports
pytest once and forks a child per run: the child changes into the repository, puts it first on sys.path
(as `python -m pytest` does), runs `pytest.main(args)` with its output sent to a file, and exits; the parent
reads the output back. A fork starts from the same interpreter state every time and the package under
test is only ever imported in the child, so a run is isolated as a fresh process is (tests/test_nano.py
checks that warm and fresh runs give the same rows).

Why by hand: pytest-xdist and similar keep warm workers for the tests of one suite; here every run is a
different repository and must not see the previous one's imports, which a fork per run guarantees.

    with WarmPytest(plugin_dir, env) as worker:
        output = worker.run(repo, ["-rA", ...], timeout=120)   # None on timeout
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class WarmPytest:
    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "crr.tasks.warm"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, repo: Path, args: list[str], timeout: float) -> str | None:
        self.proc.stdin.write(json.dumps({"cwd": str(repo), "args": args, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the warm pytest worker died")
        return json.loads(line)["output"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> WarmPytest:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run_child(request: dict, out_path: str) -> None:
    import pytest

    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])
    fd = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        code = int(pytest.main(request["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import importlib
    from importlib.metadata import entry_points

    import pytest  # noqa: F401  (imported once here; every fork inherits it)

    # The plugins pytest autoloads (setuptools entry points): imported once here too, so a child finds them
    # in sys.modules; third-party code, never the repository under test.
    for ep in entry_points(group="pytest11"):
        try:
            importlib.import_module(ep.module)
        except Exception:  # a broken plugin fails in the child exactly as in a fresh run
            pass

    fd, out_path = tempfile.mkstemp(prefix="crr-warm-pytest-")
    os.close(fd)
    try:
        for line in sys.stdin:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _run_child(request, out_path)
            deadline = time.monotonic() + request["timeout"]
            while True:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                select.select([], [], [], 0.005)
            output = None if not done else Path(out_path).read_text(errors="replace")
            sys.stdout.write(json.dumps({"output": output}) + "\n")
            sys.stdout.flush()
    finally:
        os.unlink(out_path)


if __name__ == "__main__":
    main()
