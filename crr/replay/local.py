"""The `local` fork engine: sandboxes are copy-on-write workspaces on this machine (paper:
Preliminaries, "forkable at horizon h"; the fork cost is Appendix "Rollout-Dispatch Cost Breakdown").

Each sandbox is an overlay workspace (crr.replay.overlay) over the task's cached base checkout, so
a snapshot copies only the diff and a restore is one mount: a fork costs milliseconds. Commands run
with bash in the repository root. Where mount namespaces work (root), each command sees the
repository at /testbed (as in a SWE-bench image) and its scratch space at /tmp/crr-sandbox: observations then
never carry a host path, so the same seed gives the same trajectories in any sandbox on any engine.

What each command is held to (probed once per process; a missing piece is logged once):
- its own session; at the timeout its process group gets SIGTERM, then SIGKILL after a short grace;
- a fresh PID namespace (`unshare --pid --kill-child`): when the command's shell ends or is killed,
  the kernel kills everything it started, including processes that left the group with setsid;
- a network namespace per sandbox with only its own loopback up: no network, yet tests that serve
  on 127.0.0.1 work, and concurrent forks never contend for the same port. The one door is an engine
  made with `record_http=True` (the determinism filter's recording run, crr.replay.http): its
  sandboxes share the host's network and record their HTTP traffic;
- a pids cgroup per engine (`pids.max`, cgroup v1): a fork bomb hits the cap, not the machine
  (RLIMIT_NPROC counts all of the user's processes and is not enforced for root at all). Commands
  are born in it: they are spawned from one thread that joined it once, because moving each new
  process into a cgroup waits for an RCU grace period (5-25 ms a command here). The same thread
  enters a sandbox's network namespace (setns) before spawning its command;
- per-process RLIMIT_AS (memory), RLIMIT_FSIZE (runaway files) and RLIMIT_CORE = 0;
- a mount namespace per sandbox in which its workspace is bound at /testbed and its scratch
  directory at FIXED_TMP_DIR (on the host both are empty mount points, made once; /tmp itself stays
  the host's, since crr's own interpreter may live there). Like the network
  namespace it is made once, on the spawner thread with mount(2) (no process per command), and the
  spawner enters it before starting each command. A task with an environment (crr.replay.mirror)
  also gets its cached environment bound read-only at /opt/crr, as its Docker image has it.
Without root only the session, the timeout kill, the rlimits and plain copies remain.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Self

from crr.errors import CRRError, SandboxError
from crr.replay import http, mirror
from crr.replay.base import BoundedOutput, ClosingSandbox, ExecResult, Snapshot, TaskSpec
from crr.replay.checkout import base_checkout, cache_root
from crr.replay.overlay import (CopyWorkspace, Layer, OverlayWorkspace, Workspace, mounts_under, overlay_unavailable,
                               process_start, unmount)

log = logging.getLogger(__name__)

OWNER_FILE = "crr-owner.json"  # marks an engine dir as crr's and names the process that owns it
_PREFIX = "crr-engine-"
_GRACE_S = 0.5  # between SIGTERM and SIGKILL at a timeout
CGROUP_REMOVE_S = 5.0  # how long closing an engine waits for its pids cgroup to empty
FIXED_REPO_DIR = "/testbed"  # where commands see the repository, as in SWE-bench images
FIXED_TMP_DIR = "/tmp/crr-sandbox"  # and their scratch space (TMPDIR, HOME)
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CLONE_NEWNET, _CLONE_NEWNS, _CLONE_FS, _SIOCSIFFLAGS, _IFF_UP = 0x40000000, 0x20000, 0x200, 0x8914, 0x1
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)
_live: set[LocalEngine] = set()  # strong: an engine left unclosed still holds mounts until exit
_warned: set[str] = set()


def default_workdir() -> Path:
    return cache_root() / "sandboxes"


class LocalEngine:
    """Fork engine over local overlay workspaces (plain copies where overlayfs is unavailable).

    overlay: True requires overlayfs, False forces plain copies, None picks overlay when it works.
    mem_limit_mb / fsize_limit_mb are per-process rlimits; pids_limit caps the processes of all its
    sandboxes together (their commands and everything those start). record_http: sandboxes get the
    host's network and record HTTP (crr.replay.http); only the determinism filter's recording run.
    """

    name = "local"

    def __init__(self, workdir: Path | None = None, overlay: bool | None = None, mem_limit_mb: int = 2048,
                 fsize_limit_mb: int = 1024, pids_limit: int = 1024, record_http: bool = False):
        self.record_http = record_http
        self.workdir = Path(workdir) if workdir else default_workdir()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.mode = "copy" if overlay is False else "overlay"
        if overlay is not False and (why := overlay_unavailable(self.workdir)):
            if overlay:
                raise SandboxError(f"overlayfs is unavailable under {self.workdir}: {why}")
            _warn_once(f"overlayfs is unavailable under {self.workdir} ({why}); local sandboxes fall "
                       "back to plain copies (each start, snapshot and restore copies the whole tree)",
                       key=f"copy fallback under {self.workdir}")
            self.mode = "copy"
        self._workspace = OverlayWorkspace if self.mode == "overlay" else CopyWorkspace
        self._limits = (mem_limit_mb, fsize_limit_mb)
        self._unshare = _pid_namespace()
        self.dir = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"{_PREFIX}{os.getpid()}-"))
        owner = {"pid": os.getpid(), "start": process_start(os.getpid())}
        (self.dir / OWNER_FILE).write_text(json.dumps(owner))
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crr-spawn")
        self._cgroup = self._join_pids_cgroup(pids_limit)
        self._netns = self._probe_netns()
        self._host_mntns = self._probe_mntns()  # an fd on the host's mount namespace, or None
        self.enforced = {"pid_namespace": bool(self._unshare), "net_namespace": self._netns and not record_http,
                         "fixed_repo_dir": self._host_mntns is not None,
                         "pids_cgroup": self._cgroup is not None, "rlimits": "as,fsize,core"}
        self._sandboxes: set[LocalSandbox] = set()
        self._snapshots: dict[str, tuple[Layer, TaskSpec]] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        _live.add(self)

    def start(self, task: TaskSpec) -> LocalSandbox:
        base = base_checkout(task)
        sb = self._open(task, lambda root: self._workspace(root, base))
        return http.install_cassette(sb, self.record_http)

    def restore(self, snapshot: Snapshot) -> LocalSandbox:
        with self._lock:
            entry = self._snapshots.get(snapshot.id)
        if entry is None:
            raise CRRError(f"snapshot {snapshot.id} is not held by this local engine "
                           "(released, from another engine, or the engine was closed)")
        layer, task = entry
        return self._open(task, lambda root: self._workspace.restore(layer, root))

    def release(self, snapshot: Snapshot) -> None:
        with self._lock:
            entry = self._snapshots.pop(snapshot.id, None)
        if entry is not None:
            entry[0].release()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sandboxes, self._sandboxes = list(self._sandboxes), set()
            layers = [layer for layer, _ in self._snapshots.values()]
            self._snapshots.clear()
        for sb in sandboxes:
            sb.close()
        for layer in layers:
            layer.release()
        self._spawner.shutdown()  # its thread leaves the cgroup by exiting
        if self._host_mntns is not None:
            os.close(self._host_mntns)
        _remove_cgroup(self._cgroup)
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, task: TaskSpec, make_workspace) -> LocalSandbox:
        with self._lock:
            if self._closed:
                raise CRRError("this local engine is closed; make a new one")
            k = next(self._seq)
        environment = mirror.local_environment(task.mirror["requirements"]) if task.mirror else None
        sb_dir = self.dir / f"sb-{k}"
        for d in (sb_dir, sb_dir / "tmp", sb_dir / "tmp" / "home"):
            d.mkdir()
        namespaces: dict[int, int] = {}  # CLONE_NEW* -> an fd on the sandbox's namespace
        workspace = None
        try:
            if self._netns:  # named even when recording: the spawner thread sits in the last one it made
                namespaces[_CLONE_NEWNET] = (_host_netns() if self.record_http
                                             else self._spawner.submit(_new_netns).result())
            workspace = make_workspace(sb_dir / "ws")
            if self._host_mntns is not None:
                namespaces[_CLONE_NEWNS] = self._spawner.submit(
                    _new_mntns, self._host_mntns, str(workspace.tree), str(sb_dir / "tmp"),
                    environment and str(environment)).result()
        except BaseException:
            for fd in namespaces.values():
                os.close(fd)
            if workspace is not None:
                workspace.close()
            shutil.rmtree(sb_dir, ignore_errors=True)
            raise
        sb = LocalSandbox(self, task, workspace, sb_dir, namespaces, environment)
        with self._lock:
            self._sandboxes.add(sb)
        return sb

    def _snapshot(self, sb: LocalSandbox) -> Snapshot:
        with self._lock:
            if self._closed:
                raise CRRError("this local engine is closed; make a new one")
            k = next(self._seq)
        layer = sb.workspace.snapshot(self.dir / f"snap-{k}")
        snap = Snapshot(id=uuid.uuid4().hex[:16], engine=self.name, task_id=sb.task.instance_id,
                        handle={"path": str(layer.path), "mode": self.mode})
        with self._lock:
            self._snapshots[snap.id] = (layer, sb.task)
        return snap

    def _popen(self, command: str, namespaces: dict[int, int], **kwargs) -> subprocess.Popen:
        """Start `bash -c command` from the spawner thread, in the pids cgroup and the sandbox's
        network and mount namespaces.

        unshare's child, PID 1 of the new namespace, is a small sh that sets the rlimits and runs
        bash (as PID 1, bash would ignore even `kill -9 $$`). A wrapper rather than a preexec_fn
        lets Popen vfork: forking a trainer with gigabytes of resident memory costs tens of ms.
        """
        if "\0" in command:
            raise CRRError("a command cannot contain a NUL byte")
        mem_mb, fsize_mb = self._limits
        limits = f"ulimit -v {mem_mb * 1024}; ulimit -f {fsize_mb * 2048}; ulimit -c 0"
        init = f'{limits}; "$@"; exit $?' if self._unshare else f'{limits}; exec "$@"'
        argv = [*self._unshare, "/bin/sh", "-c", init, "sh", "bash", "-c", command]
        future = self._spawner.submit(_spawn, namespaces, self._host_mntns, argv, **kwargs)
        try:
            return future.result()
        except BlockingIOError:
            raise SandboxError(f"cannot start a command: too many processes (this engine's pids cgroup "
                               f"{self._cgroup}; a fork bomb still running in another sandbox?)") from None
        except OSError as e:
            if e.errno == errno.E2BIG:
                raise CRRError(f"command too long ({len(command.encode())} bytes; the kernel takes at most "
                               "128 KiB in one argument): write large files with write_file") from None
            raise SandboxError(f"cannot start a command: {e}") from e
        except BaseException:
            # Interrupted while spawning: don't leave it running.
            future.add_done_callback(functools.partial(_kill_spawned, pid_namespace=bool(self._unshare)))
            raise

    def _probe_mntns(self) -> int | None:
        """Give the spawner thread its own fs context (so it may switch mount namespaces) and try a
        sandbox mount namespace once; an fd on the host's mount namespace, or None (host paths)."""
        if not self._unshare:
            return None
        try:
            os.makedirs(FIXED_REPO_DIR, exist_ok=True)
            os.makedirs(FIXED_TMP_DIR, exist_ok=True)
            os.makedirs(mirror.ENV_ROOT, exist_ok=True)
            host = self._spawner.submit(_own_fs_context).result()
            os.close(self._spawner.submit(_new_mntns, host, str(self.dir), str(self.dir)).result())
            return host
        except OSError as e:
            _warn_once(f"cannot bind the repository at {FIXED_REPO_DIR} ({e}): local sandbox commands see "
                       "it at its host path, which then shows up in observations")
            return None

    def _probe_netns(self) -> bool:
        try:
            os.close(self._spawner.submit(_new_netns).result())
            return True
        except OSError as e:
            _warn_once(f"network namespaces are unavailable ({e}): local sandbox commands can reach the "
                       "network")
            return False

    def _join_pids_cgroup(self, limit: int) -> Path | None:
        """Make this engine's pids cgroup and move the spawner thread (only it) into it, once."""
        if (root := _pids_cgroup_root()) is None:
            return None
        cgroup = root / self.dir.name
        try:
            cgroup.mkdir()
            (cgroup / "pids.max").write_text(str(limit))
            self._spawner.submit(_join_thread, cgroup).result()
            return cgroup
        except OSError as e:
            _remove_cgroup(cgroup)
            _warn_once(f"cannot use a pids cgroup under {root} ({e}): a fork bomb in a local sandbox is "
                       "stopped only by its timeout")
            return None


class LocalSandbox(ClosingSandbox):
    """One task's repository in a local workspace; commands run as processes in `repo_dir`."""

    def __init__(self, engine: LocalEngine, task: TaskSpec, workspace: Workspace, sb_dir: Path,
                 namespaces: dict[int, int], environment: Path | None = None):
        self.task, self.workspace = task, workspace
        self._root = workspace.tree.resolve()
        self._engine, self._dir, self._namespaces = engine, sb_dir, namespaces
        fixed = _CLONE_NEWNS in namespaces
        self.repo_dir = FIXED_REPO_DIR if fixed else str(workspace.tree)
        tmp = FIXED_TMP_DIR if fixed else str(sb_dir / "tmp")
        self._env = {
            "PATH": f"{os.path.dirname(sys.executable)}:{_SYSTEM_PATH}",
            "HOME": f"{tmp}/home", "TMPDIR": tmp, "LANG": "C.UTF-8", "TZ": "UTC",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
        }
        if environment is not None:  # the task's own Python environment replaces crr's
            root = mirror.ENV_ROOT if fixed else str(environment)
            self._env.update(mirror.sandbox_env(root, self.repo_dir, record=engine.record_http))
        self._closed = False

    def exec(self, command: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> ExecResult:
        """Run `command` with bash in the repository root; `env` adds to or overrides the clean env."""
        self._check_open()
        start = time.monotonic()
        proc = self._engine._popen(command, self._namespaces, cwd=self.repo_dir, env={**self._env, **(env or {})}, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        out, timed_out = BoundedOutput(), False
        try:
            timed_out = not _drain(proc, out, start + timeout)
        finally:  # also on KeyboardInterrupt: nothing the command started outlives this call
            _stop(proc, graceful=timed_out, pid_namespace=bool(self._engine._unshare))
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
        for fd in self._namespaces.values():
            os.close(fd)  # a namespace goes with its last process and fd (the binds with it)
        self.workspace.close()
        shutil.rmtree(self._dir, ignore_errors=True)
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


def gc_leftovers(workdir: Path | None = None) -> list[str]:
    """Remove the mounts, dirs and pids cgroups of local engines whose owning process is gone.

    Only crr's: an engine dir carries OWNER_FILE with its owner's pid and start time, so a live
    engine (or a reused pid) is never touched; an engine's cgroup is named after its dir and holds
    its owner's spawner thread for as long as the owner lives. Returns what was removed.
    """
    root = Path(workdir) if workdir else default_workdir()
    removed: list[str] = []
    cgroups = _pids_cgroup_root()
    for cgroup in sorted(cgroups.glob(f"{_PREFIX}*")) if cgroups else []:
        try:
            owner_pid = cgroup.name.split("-")[2]
            if owner_pid in (cgroup / "cgroup.procs").read_text().split() or process_start(int(owner_pid)):
                continue  # the owner lives (its spawner thread is in it, or is joining it right now)
        except (OSError, IndexError, ValueError):
            continue
        _kill_cgroup(cgroup)  # commands in flight when the owner died: before unmounting their cwd
        _remove_cgroup(cgroup)
        removed.append(str(cgroup))
    for d in sorted(root.glob(f"{_PREFIX}*")) if root.is_dir() else []:
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not an engine dir, or one being created right now
        if process_start(owner.get("pid", -1)) == owner.get("start"):
            continue
        for mnt in mounts_under(d):
            unmount(mnt)
            removed.append(mnt)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    if removed:
        log.info("removed %d leftovers of crashed local engines under %s", len(removed), root)
    return removed


@atexit.register
def _close_all() -> None:
    for engine in list(_live):
        engine.close()


def _drain(proc: subprocess.Popen, out: BoundedOutput, deadline: float) -> bool:
    """Read the command's output into `out` until EOF (True) or `deadline` (False).

    Reads on even when the output is truncated: a writer blocked on a full pipe would never end.
    """
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(min(left, 0.1)):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return True
                out.feed(chunk)
            elif proc.poll() is not None:
                _signal_group(proc.pid, signal.SIGKILL)  # the shell is done; stragglers hold the pipe
    return False


def _join_thread(cgroup: Path) -> None:
    """Move the calling thread (only it: cgroup v1 `tasks` takes a thread id) into `cgroup`."""
    (cgroup / "tasks").write_text(str(threading.get_native_id()))


def _kill_spawned(future: Future, pid_namespace: bool) -> None:
    if not future.cancelled() and future.exception() is None:
        _stop(future.result(), graceful=False, pid_namespace=pid_namespace)


def _stop(proc: subprocess.Popen, graceful: bool, pid_namespace: bool) -> None:
    """End the command and everything it started (in a PID namespace: returns once they are gone)."""
    if graceful and proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    if pid_namespace and proc.poll() is None:
        # Kill unshare's child (the namespace's PID 1) first: the kernel then kills and reaps the whole
        # namespace before unshare can reap PID 1 and exit, so the wait below outlasts every process.
        for pid in _children(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _kill_cgroup(cgroup: Path) -> None:
    """SIGKILL every process in a dead engine's cgroup."""
    for _ in range(50):
        try:
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.warning("processes keep appearing in %s", cgroup)


def _remove_cgroup(cgroup: Path | None) -> None:
    if cgroup is None:
        return
    # rmdir fails (EBUSY) until the killed processes are reaped and the spawner thread has exited: under
    # load that takes seconds, not the milliseconds it takes on an idle machine
    deadline = time.monotonic() + CGROUP_REMOVE_S
    while True:
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
    log.warning("could not remove cgroup %s", cgroup)


@functools.cache
def _pid_namespace() -> list[str]:
    """The `unshare` prefix that gives each command a PID namespace, or [] where it cannot (probed once)."""
    unshare = shutil.which("unshare")
    prefix = [unshare, "--pid", "--kill-child", "--"] if unshare else []
    if prefix and subprocess.run([*prefix, "true"], capture_output=True, check=False).returncode == 0:
        return prefix
    _warn_once("PID namespaces are unavailable (needs root and util-linux unshare): only the process "
               "group of a local sandbox command is killed when it ends")
    return []


def _new_netns() -> int:
    """Move the calling thread into a fresh network namespace with its loopback up; an fd on it.

    ctypes because Python 3.11 has neither os.unshare nor os.setns; the ioctl is `ip link set lo up`.
    """
    if _libc.unshare(_CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a socket of the new namespace
        ifreq = struct.pack("16sH22x", b"lo", _IFF_UP)
        fcntl.ioctl(s, _SIOCSIFFLAGS, ifreq)
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _host_netns() -> int:
    """An fd on the host's network namespace (the main thread's: only the spawner thread unshares)."""
    return os.open(f"/proc/{os.getpid()}/ns/net", os.O_RDONLY | os.O_CLOEXEC)


def _spawn(namespaces: dict[int, int], host_mntns: int | None, argv: list[str], **kwargs) -> subprocess.Popen:
    """On the spawner thread: enter the sandbox's namespaces, then start the command there."""
    for kind, fd in namespaces.items():
        _check(_libc.setns(fd, kind))
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        # Leave the sandbox's mount namespace at once: the thread must not be what keeps a closed
        # sandbox's namespace alive, or tearing it down (an RCU grace period, ~20 ms) would land on
        # the next restore instead of on that sandbox's close.
        if _CLONE_NEWNS in namespaces:
            _check(_libc.setns(host_mntns, _CLONE_NEWNS))


def _check(ret: int) -> None:
    if ret != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _own_fs_context() -> int:
    """On the spawner thread: stop sharing cwd/root with the other threads (setns into a mount
    namespace requires it) and return an fd on the host's mount namespace."""
    _check(_libc.unshare(_CLONE_FS))
    return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


def _new_mntns(host: int, tree: str, tmp: str, environment: str | None = None) -> int:
    """On the spawner thread: a mount namespace (made from the host's, so no other sandbox's binds
    come along) where `tree` is FIXED_REPO_DIR, `tmp` is FIXED_TMP_DIR and `environment`, when given,
    is mirror.ENV_ROOT, read-only (it is shared by every sandbox of its lock); an fd on it."""
    _check(_libc.setns(host, _CLONE_NEWNS))
    try:
        _check(_libc.unshare(_CLONE_NEWNS))
        _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None))  # nothing leaks to the host
        _check(_libc.mount(tree.encode(), FIXED_REPO_DIR.encode(), None, _MS_BIND, None))
        _check(_libc.mount(tmp.encode(), FIXED_TMP_DIR.encode(), None, _MS_BIND, None))
        if environment is not None:
            target = mirror.ENV_ROOT.encode()
            _check(_libc.mount(environment.encode(), target, None, _MS_BIND, None))
            _check(_libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None))
        return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        _check(_libc.setns(host, _CLONE_NEWNS))


@functools.cache
def _pids_cgroup_root() -> Path | None:
    """The dir under which each engine gets a pids cgroup, or None.

    cgroup v1 only: v1 can move a single thread, v2 would need a threaded subtree.
    """
    root = Path("/sys/fs/cgroup/pids/crr")
    try:
        root.mkdir(exist_ok=True)
        return root
    except OSError as e:
        _warn_once(f"no writable cgroup-v1 pids hierarchy ({e}): a fork bomb in a local sandbox is "
                   "stopped only by its timeout")
        return None


def _warn_once(message: str, key: str | None = None) -> None:
    if (key or message) not in _warned:
        _warned.add(key or message)
        log.warning(message)
