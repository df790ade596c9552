"""One local sandbox: its workspace, the commands run in its root, its files confined to the repository."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from crr.errors import CRRError
from crr.sandbox import mirror
from crr.sandbox.base import BoundedOutput, ClosingSandbox, ExecResult, Snapshot, TaskSpec
from crr.sandbox.local.common import _CLONE_NEWNS, _SYSTEM_PATH, FIXED_REPO_DIR, FIXED_TMP_DIR
from crr.sandbox.local.containment import _drain, _stop
from crr.sandbox.local.reclaim import _dispose
from crr.sandbox.overlay import Workspace

log = logging.getLogger(__name__)


class LocalSandbox(ClosingSandbox):
    """One task's repository in a local workspace; commands run as processes in `repo_dir`."""

    def __init__(self, engine, task: TaskSpec, workspace: Workspace, sb_dir: Path,
                 namespaces: dict[int, int], memcg: Path | None, mounted: bool, environment: Path | None = None):
        self.task, self.workspace = task, workspace
        self._root = workspace.tree.resolve()
        self._engine, self._dir, self._namespaces = engine, sb_dir, namespaces
        self._memcg, self._mounted = memcg, mounted
        fixed = _CLONE_NEWNS in namespaces
        self.repo_dir = FIXED_REPO_DIR if fixed else str(workspace.tree)
        tmp = FIXED_TMP_DIR if fixed else str(sb_dir / "tmp" / "crr-sandbox")
        self._env = {
            "PATH": f"{os.path.dirname(sys.executable)}:{_SYSTEM_PATH}",
            "HOME": f"{tmp}/home", "TMPDIR": tmp, "LANG": "C.UTF-8", "TZ": "UTC",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
        }
        if environment is None:
            # crr's interpreter stands in for the task's environment, and the pytest plugins installed there
            # (xdist, timeout, anyio, ...) are crr's dependencies, not the task's: loaded at every run they cost
            # half of it (0.50 -> 0.26 s a run_tests call or verifier run, scripts/pytest_cost.py) and put crr's
            # dependency versions into the agent's observations. A task that needs one names it (`-p name`).
            self._env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        else:  # the task's own Python environment replaces crr's, its plugins included
            root = mirror.ENV_ROOT if fixed else str(environment)
            self._env.update(mirror.sandbox_env(root, self.repo_dir, record=engine.record_http))
        self._closed = False

    def exec(self, command: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> ExecResult:
        """Run `command` with bash in the repository root; `env` adds to or overrides the clean env."""
        self._check_open()
        start = time.monotonic()
        proc = self._engine._popen(command, self._namespaces, self._memcg, cwd=self.repo_dir,
                                   env={**self._env, **(env or {})}, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        out, timed_out = BoundedOutput(), False
        try:
            timed_out = not _drain(proc, out, start + timeout)
        finally:  # also on KeyboardInterrupt: nothing the command started outlives this call
            _stop(proc, graceful=timed_out, pid_namespace=self._engine.enforced["pid_namespace"])
            if timed_out:
                _drain(proc, out, time.monotonic() + 0.2)
            proc.stdout.close()
        code = 124 if timed_out else (128 - proc.returncode if proc.returncode < 0 else proc.returncode)
        return ExecResult(exit_code=code, output=out.text(), timed_out=timed_out, truncated=out.truncated,
                          duration_s=time.monotonic() - start)

    def read_file(self, path: str) -> bytes:
        full = self._resolve(path)
        try:
            return full.read_bytes()
        except OSError as e:
            raise CRRError(f"cannot read {path!r} in {self.task.instance_id}: {e.strerror}") from None

    def write_file(self, path: str, data: bytes) -> None:
        full = self._resolve(path)
        try:
            full.parent.mkdir(parents=True, exist_ok=True)
            full.write_bytes(data)
        except OSError as e:
            raise CRRError(f"cannot write {path!r} in {self.task.instance_id}: {e.strerror}") from None

    def snapshot(self) -> Snapshot:
        self._check_open()
        return self._engine._snapshot(self)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _dispose(self._dir, self.workspace, self._namespaces, self._memcg, self._mounted)
        with self._engine._lock:
            self._engine._sandboxes.discard(self)


    def _resolve(self, path: str) -> Path:
        """The real path of `path` (relative to the repository root, or absolute inside it)."""
        self._check_open()
        if os.path.isabs(path) and (path + "/").startswith(self.repo_dir.rstrip("/") + "/"):
            path = os.path.relpath(path, self.repo_dir)  # /testbed/x as commands see it
        full = (self._root / path).resolve()  # follows symlinks, so a link to /etc lands outside
        if not full.is_relative_to(self._root):
            raise CRRError(f"path {path!r} resolves to {full}, outside the repository {self.repo_dir}; "
                           "tools may only touch files inside the repository")
        return full
