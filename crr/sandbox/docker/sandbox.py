"""One Docker sandbox: a container whose /testbed holds the task's repository, its commands run through
the command channel (package doc), its files read and written through the Docker API."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import select
import shlex
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
import docker
import docker.errors
import requests

from crr.errors import CRRError, SandboxError
from crr.sandbox import mirror
from crr.sandbox.base import BoundedOutput, ClosingSandbox, ExecResult, Snapshot, TaskSpec
from crr.sandbox.docker.common import _ACTION, DEFAULT_ENV, REPO_DIR, _Container
from crr.sandbox.docker.disk import _FULL_SLACK, LAYER_POLL_S, DiskWatch, _kill_namespace
from crr.sandbox.overlay import OverlayWorkspace

log = logging.getLogger(__name__)

_GRACE_S = 10.0  # client-side guard: how long past its timeout an action may run before we step in


def _create_new(path: Path, data: bytes) -> None:
    # O_EXCL | O_NOFOLLOW: the container can write into its control dir, so never follow its links.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _read_small(path: Path, limit: int = 4096) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


class DockerSandbox(DiskWatch, ClosingSandbox):
    """One container whose /testbed holds the task's repository; see the package doc."""

    repo_dir = REPO_DIR

    def __init__(self, engine, task: TaskSpec, box: _Container, image: str, depth: int = 0,
                 snapshot_id: str | None = None, workspace: OverlayWorkspace | None = None):
        # engine: the DockerEngine that made it (not annotated: its module imports this one)
        self.engine, self.task, self.box, self.image, self.depth = engine, task, box, image, depth
        self.name = box.name
        self.snapshot_id = snapshot_id  # the snapshot this sandbox was restored from (keeps it alive)
        self.workspace = workspace      # overlay mode only
        self._closed = False
        self._env = DEFAULT_ENV if not task.mirror else {
            **DEFAULT_ENV, **mirror.sandbox_env(mirror.ENV_ROOT, REPO_DIR, record=engine.record_http)}
        self._api = engine.api
        self._lock = threading.Lock()   # one action at a time: an action's end kills all processes
        self.disk_used = 0              # commit mode, watched: bytes of box.watch at the last measurement
        self._written = 0               # ... PID 1's write_bytes then, and actions since (_after_action)
        self._unmeasured = 0

    # -- running commands ----------------------------------------------------------------------

    def exec(self, command: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> ExecResult:
        """Run `command` with bash in /testbed; `env` adds to or overrides DEFAULT_ENV (and the
        variables of the task's environment)."""
        if timeout <= 0:
            raise CRRError(f"timeout must be positive, got {timeout}")
        env = {**self._env, **(env or {})}
        if bad := [k for k in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]:
            raise CRRError(f"invalid environment variable name(s) {bad}")
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        cap = self.engine.disk_limit_mb << 20
        with self._lock:
            self._check_open()
            # Over the cap, as on a full disk, deleting works and writing fails ("File too large", no signal).
            full = "ulimit -f 0; trap '' XFSZ\n" if self.box.watch and self.disk_used > cap else ""
            script = f"{full}set -- {timeout:.3f} {shlex.quote(command)}\n{exports}{_ACTION}"
            start = time.monotonic()
            action = self.box.ctl / uuid.uuid4().hex[:16]
            try:
                os.mkdir(action)
            except OSError as e:  # its tmpfs filled, or the dir replaced, from inside
                raise SandboxError(f"the command channel of container {self.name} (task {self.task.instance_id}) "
                                   f"is broken ({e.strerror}); close this sandbox") from None
            try:
                _create_new(action / "cmd", script.encode())
                os.mkfifo(action / "out")
                out = BoundedOutput()
                fd = os.open(action / "out", os.O_RDONLY | os.O_NONBLOCK)
                try:
                    self._request(action.name)
                    limit = cap if self.disk_used <= cap else self.disk_used + _FULL_SLACK
                    stopped = self._drain(fd, out, timeout, limit)
                finally:
                    os.close(fd)
                rc, notice = _read_small(action / "rc"), _read_small(action / "err") or b""
            finally:
                shutil.rmtree(action, ignore_errors=True)
            if self.box.watch and (self._after_action(cap, stopped) > cap or stopped):
                out.feed(self._disk_full_notice(stopped))
        if rc is None or not rc.strip().isdigit():
            self._check_alive(settle_s=5.0)  # a container killed mid-command is not a failing test
            raise SandboxError(f"an action in container {self.name} (task {self.task.instance_id}) ended "
                               "without an exit status; its command channel was tampered with")
        code = int(rc)
        timed_out = code in (124, 137) and b"timeout" in notice
        return ExecResult(exit_code=124 if timed_out else code, output=out.text(), timed_out=timed_out,
                          truncated=out.truncated, duration_s=time.monotonic() - start)

    def _request(self, action_id: str) -> None:
        """Hand an action to PID 1; a container without one is dead, never a hang."""
        try:
            fd = os.open(self.box.ctl / "req", os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nobody reads the FIFO: PID 1 is gone
                self._check_alive(settle_s=5.0)
            raise SandboxError(f"the command channel of container {self.name} (task "
                               f"{self.task.instance_id}) is broken ({e.strerror}); close this sandbox") from None
        try:
            os.write(fd, f"{action_id}\n".encode())
        finally:
            os.close(fd)

    def _drain(self, fd: int, out: BoundedOutput, timeout: float, disk_limit: int) -> bool:
        """Read the action's output until EOF. The in-container `timeout` normally ends it; past
        that, kill every process, and past that, give up on a wedged container. With a watched layer
        (commit mode, no quota), measure it every `LAYER_POLL_S` (or 10x the measurement's own cost, at most 1 s)
        and kill the action once it passes `disk_limit` bytes; True if that happened."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline, killed = time.monotonic() + timeout + _GRACE_S, False
        stopped, next_check = False, time.monotonic() + LAYER_POLL_S
        while True:
            now = time.monotonic()
            if self.box.watch and not stopped and now >= next_check:
                if self._measure() > disk_limit:
                    log.info("%s: %d MB written, over the %d MB disk cap; stopping the action", self.name,
                             self.disk_used >> 20, self.engine.disk_limit_mb)
                    self._kill_all()
                    stopped = True
                next_check = time.monotonic() + max(LAYER_POLL_S, min(10 * (time.monotonic() - now), 1.0))
            left = deadline - time.monotonic()
            if left <= 0:
                if killed:
                    raise SandboxError(f"an action in container {self.name} (task {self.task.instance_id}) "
                                       f"did not end {2 * _GRACE_S:.0f} s after its {timeout} s timeout, even "
                                       "after its processes were killed; the container is wedged")
                log.warning("%s: action still running %.0f s past its timeout; killing it", self.name, _GRACE_S)
                self._kill_all()
                deadline, killed = time.monotonic() + _GRACE_S, True
                continue
            wait = min(left, next_check - time.monotonic()) if self.box.watch and not stopped else left
            if not poller.poll(max(wait, 0.0) * 1000):
                continue
            data = os.read(fd, 1 << 16)
            if not data:  # EOF: the action and everything it started are gone
                return stopped
            out.feed(data)

    def _pid1(self) -> int:
        """PID 1 of the container on the host (overlay mode knows it from the start; commit mode asks once)."""
        if not self.box.pid:
            with self._call("find the container's PID 1"):
                self.box.pid = self._api.inspect_container(self.box.id)["State"]["Pid"]
        return self.box.pid

    def _kill_all(self) -> None:
        """SIGKILL every process of the container but PID 1. As root, from the host (a few ms: the disk
        watch's overshoot depends on it); otherwise through `docker exec` (~100-250 ms)."""
        if os.geteuid() == 0 and _kill_namespace(self._pid1()):
            return
        with self._call("kill a runaway action"):
            exec_id = self._api.exec_create(self.box.id, ["sh", "-c", "kill -9 -1"])["Id"]
            self._api.exec_start(exec_id)

    # -- files ---------------------------------------------------------------------------------

    def read_file(self, path: str) -> bytes:
        real, kind, _ = self._resolve(path, make_parent=False)
        if kind not in ("regular file", "regular empty file"):
            raise CRRError(f"{path}: {kind or 'no such file'} in the repository of task {self.task.instance_id}")
        with self._call(f"read {path}"):
            stream, _ = self._api.get_archive(self.box.id, real)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                return tar.extractfile(tar.next()).read()

    def write_file(self, path: str, data: bytes) -> None:
        real, kind, mode = self._resolve(path, make_parent=True)
        if kind == "directory":
            raise CRRError(f"{path} is a directory in the repository of task {self.task.instance_id}")
        info = tarfile.TarInfo(os.path.basename(real))
        info.size, info.mtime = len(data), int(time.time())
        info.mode = int(mode, 8) if mode else 0o644  # an edit keeps the file's mode
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.addfile(info, io.BytesIO(data))
        with self._call(f"write {path}"):
            self._api.put_archive(self.box.id, os.path.dirname(real), buf.getvalue())

    def _resolve(self, path: str, make_parent: bool) -> tuple[str, str, str]:
        """(real path, file type or "", octal mode or "") of `path` in the repository, resolved by
        `realpath` inside the container, so that symlinks are judged where they live."""
        if not path or os.path.isabs(path) or ".." in Path(path).parts:
            raise CRRError(f"{path!r} is not a path inside the repository: use a path relative to "
                           f"{REPO_DIR} without '..'")
        mkdir = 'mkdir -p -- "$(dirname -- "$p")" || exit 4; ' if make_parent else ""
        res = self.exec(f'p=$(realpath -m -- {shlex.quote(path)}) || exit 3; case "$p" in {REPO_DIR}/*) ;; '
                        f'*) echo "$p"; exit 3;; esac; {mkdir}echo "$p"; stat -c "%F:%a" -- "$p" 2>/dev/null; '
                        "exit 0", timeout=30)
        lines = res.output.splitlines()
        if res.exit_code == 3:
            raise CRRError(f"{path!r} resolves to {lines[-1] if lines else '?'}, outside the repository "
                           f"{REPO_DIR} of task {self.task.instance_id}")
        if res.exit_code != 0 or not lines:
            raise CRRError(f"cannot resolve {path!r} in task {self.task.instance_id}: {res.output[-300:]}")
        kind, _, mode = lines[1].rpartition(":") if len(lines) > 1 else ("", "", "")
        return lines[0], kind, mode

    # -- lifecycle -----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._lock:
            self._check_open()
            return self.engine._snapshot(self)

    def close(self) -> None:
        """Remove the container (overlay: unmount the workspace, return the container to the pool);
        idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.engine._close_sandbox(self)

    # -- container health ----------------------------------------------------------------------

    def _check_alive(self, settle_s: float = 0.0) -> None:
        """Raise a SandboxError naming the container and the task if the container is not running.

        settle_s: keep asking that long while it still looks alive (a container being killed or
        removed reports Running for a moment after its processes are gone).
        """
        deadline = time.monotonic() + settle_s
        while True:
            try:
                state = self._api.inspect_container(self.box.id)["State"]
                detail = None if state.get("Running") else f"{state.get('Status')}, exit code {state.get('ExitCode')}"
            except docker.errors.NotFound:
                detail = "removed"
            except (docker.errors.DockerException, requests.RequestException) as e:
                detail = f"the daemon cannot say: {e}"
            if detail:
                raise SandboxError(f"container {self.name} of task {self.task.instance_id} is gone ({detail}); "
                                   "this sandbox is lost: close it and start or restore another")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Docker API errors as SandboxErrors that name the container and the task."""
        try:
            yield
        except docker.errors.APIError as e:
            if e.status_code in (404, 409):  # no such container / "container ... is not running"
                self._check_alive()
            raise SandboxError(f"docker could not {what} in container {self.name} "
                               f"(task {self.task.instance_id}): {e.explanation or e}") from None
        except requests.RequestException as e:
            raise SandboxError(f"docker could not {what} in container {self.name} "
                               f"(task {self.task.instance_id}): {e}") from None

