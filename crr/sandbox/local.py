"""The `local` fork engine: sandboxes are copy-on-write workspaces on this machine (paper:
Preliminaries, "forkable at horizon h"; the fork cost is Appendix "Rollout-Dispatch Cost Breakdown").

Each sandbox is an overlay workspace (crr.sandbox.overlay) over the task's cached base checkout, so
a snapshot copies only the diff and a restore is one mount: a fork costs milliseconds.

Every command runs in its own root: the minimal Debian that scripts/build-base-image.sh keeps at
CRR_ROOTFS (default DEFAULT_ROOTFS), read-only; crr's own interpreter and virtual environment read-only
at their host paths (so `python` and its pytest are the ones the agent always saw); the sandbox's
workspace at /testbed and its private /tmp (TMPDIR and HOME under /tmp/crr-sandbox); a fresh /proc and
a minimal /dev; nothing else of the host (no /root, no /work, no Docker socket, no /sys). The command
gets new PID, mount, IPC and UTS namespaces, an empty capability bounding set (no capability, none to
regain: no_new_privs), and its sandbox's network namespace (only loopback up): it cannot see a host
process, let alone enter its namespaces, and the base checkout below /testbed is not reachable at all.

How: the root is a mount namespace per sandbox, built once when the sandbox opens (on the spawner
thread, with mount(2) and pivot_root(2), no process: ~25 mounts), which each command's spawn enters
(setns) before `unshare --pid --mount-proc` and `setpriv` (util-linux, from the root filesystem) drop
into the command. Not bubblewrap, though it is the well-kept tool for this and works here: bwrap
builds the root per command, copying and tearing down the host's mount table each time, and a fork
(snapshot + restore + one command) cost 4.6x today's (323 against 71 ms p50, `crr fork bench`, one
session on a loaded 2-core host), against a budget of 2x; built once per sandbox, it costs 1.4x (79
against 56 ms p50, forks of the two engines taken in turn). The order of the steps (mounts private
first, binds, read-only remounts, the old root detached after pivot_root, capabilities dropped last,
in the command's own process) is bwrap's.

What each sandbox is held to as a whole (probed once per engine; what is missing is said at start):
- its writable state (the overlay's upper dir and /tmp) lives on a tmpfs of `disk_limit_mb`: writing
  more fails with ENOSPC;
- a memory cgroup (v1, under crr's own) of `mem_limit_mb` for all its processes together, and its
  tmpfs pages: over it the kernel's OOM killer ends a process of that sandbox. Commands are born in
  it: the spawner thread joins it for the spawn (moving a thread costs ~0.1 ms here);
- a network namespace per sandbox with only its own loopback up: no network, yet tests that serve
  on 127.0.0.1 work, and concurrent forks never contend for the same port. The one door is an engine
  made with `record_http=True` (the determinism filter's recording run, crr.sandbox.http): its
  sandboxes share the host's network and record their HTTP traffic;
- a pids cgroup per engine (`pids.max`, cgroup v1): a fork bomb hits the cap, not the machine
  (RLIMIT_NPROC counts all of the user's processes and is not enforced for root at all). Commands
  are born in it: they are spawned from one thread that joined it once. The same thread enters a
  sandbox's network namespace (setns) before spawning its command;
- per command: its own session; at the timeout its process group gets SIGTERM, then SIGKILL after a
  short grace; a PID namespace whose end (the command's shell ending or killed) kills everything it
  started; per-process RLIMIT_AS, RLIMIT_FSIZE (runaway files) and RLIMIT_CORE = 0.
A task with an environment (crr.sandbox.mirror) also gets its cached environment bound read-only at
/opt/crr, as its Docker image has it.

Where a piece cannot be had (no root filesystem, not root, no cgroup v1), the engine says
so when it is made and then runs only crr's own generated tasks (`OWN_REPOS`) unless it is told
`trust_task_code` (--trust-task-code): without its own root a command runs as this user on the host
file system, in the repository's host path.
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
import platform
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
from crr.sandbox import http, mirror
from crr.sandbox.base import BoundedOutput, ClosingSandbox, ExecResult, Snapshot, TaskSpec
from crr.sandbox.checkout import base_checkout, cache_root
from crr.sandbox.overlay import (CopyWorkspace, Layer, OverlayWorkspace, Workspace, mount_tmpfs, mounts_under,
                               overlay_unavailable, process_start, unmount)

log = logging.getLogger(__name__)

OWNER_FILE = "crr-owner.json"  # marks an engine dir as crr's and names the process that owns it
_PREFIX = "crr-engine-"
_GRACE_S = 0.5  # between SIGTERM and SIGKILL at a timeout
CGROUP_REMOVE_S = 5.0  # how long closing an engine waits for its pids cgroup to empty
FIXED_REPO_DIR = "/testbed"  # where commands see the repository, as in SWE-bench images
FIXED_TMP_DIR = "/tmp/crr-sandbox"  # and their scratch space (TMPDIR, HOME)
DEFAULT_ROOTFS = "/var/lib/crr/rootfs"  # where scripts/build-base-image.sh keeps the sandbox root
# crr's own generated tasks (crr tasks micro, the nano tier, the fork benchmark's repository): the
# only ones an engine that cannot contain task code runs without --trust-task-code.
OWN_REPOS = ("crr/nano", "micro/", "synthetic/fork-bench")
_ROOT_FRESH = ("proc", "dev", "tmp", "sys")  # of the root's top-level dirs: made per sandbox (sys: not at all)
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # bound into each sandbox's /dev
# Run inside the sandbox's root (the root filesystem's util-linux): new PID (its PID 1 the rlimit sh,
# killed with everything under it when the command ends), IPC and UTS namespaces, a mount namespace for a
# /proc of that PID namespace; then no capability and no way to regain one.
_ENTER = ["/usr/bin/unshare", "--pid", "--ipc", "--uts", "--kill-child", "--mount-proc", "--",
          "/usr/bin/setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CLONE_NEWNET, _CLONE_NEWNS, _CLONE_FS, _SIOCSIFFLAGS, _IFF_UP = 0x40000000, 0x20000, 0x200, 0x8914, 0x1
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = (
    0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000, 0x40000)
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_live: set[LocalEngine] = set()  # strong: an engine left unclosed still holds mounts until exit
_warned: set[str] = set()


def default_workdir() -> Path:
    return cache_root() / "sandboxes"


class LocalEngine:
    """Fork engine over local overlay workspaces (plain copies where overlayfs is unavailable).

    overlay: True requires overlayfs, False forces plain copies, None picks overlay when it works.
    mem_limit_mb caps each sandbox's processes together (a memory cgroup) and each process (RLIMIT_AS);
    disk_limit_mb what a sandbox writes (its upper dir and /tmp, together); fsize_limit_mb any one
    file; pids_limit the processes of all its sandboxes together (their commands and everything those
    start). rootfs: the sandbox root (default $CRR_ROOTFS or DEFAULT_ROOTFS). trust_task_code: run any
    task even where this host cannot contain it (module doc). record_http: sandboxes get the host's
    network and record HTTP (crr.sandbox.http); only the determinism filter's recording run.
    """

    name = "local"

    def __init__(self, workdir: Path | None = None, overlay: bool | None = None, mem_limit_mb: int = 2048,
                 fsize_limit_mb: int = 1024, disk_limit_mb: int = 1024, pids_limit: int = 1024,
                 rootfs: Path | None = None, trust_task_code: bool = False, record_http: bool = False):
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
        self.disk_limit_mb, self.trust_task_code = disk_limit_mb, trust_task_code
        self.dir = Path(tempfile.mkdtemp(dir=self.workdir, prefix=f"{_PREFIX}{os.getpid()}-"))
        owner = {"pid": os.getpid(), "start": process_start(os.getpid())}
        (self.dir / OWNER_FILE).write_text(json.dumps(owner))
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="crr-spawn")
        self._cgroup = self._join_pids_cgroup(pids_limit)
        self._root, self._host_mntns = self._sandbox_root(Path(rootfs or os.environ.get("CRR_ROOTFS", DEFAULT_ROOTFS)))
        self._unshare = [] if self._root else _pid_namespace()  # _ENTER makes the PID namespace there
        self._memcg = self._memory_cgroup()
        self._tmpfs = self._probe_tmpfs()
        self._netns = self._probe_netns()
        self.enforced = {"sandbox_root": self._root is not None,
                         "pid_namespace": bool(self._root or self._unshare),
                         "net_namespace": self._netns and not record_http,
                         "memory_cgroup": self._memcg is not None, "disk_cap": self._tmpfs,
                         "pids_cgroup": self._cgroup is not None, "rlimits": "as,fsize,core"}
        # What this host cannot contain (record_http's shared network is a choice, not a lack).
        self.uncontained = [k for k, v in self.enforced.items() if not v and k != "net_namespace"]
        if not self._netns:
            self.uncontained.append("net_namespace")
        if self.uncontained:
            _warn_once(f"the local engine cannot contain task code on this host (missing: "
                       f"{', '.join(self.uncontained)}): it runs only crr's own generated tasks unless told "
                       "--trust-task-code", key="uncontained " + " ".join(self.uncontained))
        self._sandboxes: set[LocalSandbox] = set()
        self._snapshots: dict[str, tuple[Layer, TaskSpec]] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        _live.add(self)

    def start(self, task: TaskSpec) -> LocalSandbox:
        if self.uncontained and not self.trust_task_code and not own_task(task):
            raise CRRError(f"task {task.instance_id} is not one of crr's own generated tasks, and the local engine "
                           f"cannot contain task code on this host (missing: {', '.join(self.uncontained)}; "
                           "see scripts/setup.sh); run it with --engine docker, or pass --trust-task-code")
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
        self._spawner.shutdown()  # its thread leaves the cgroups by exiting
        if self._host_mntns is not None:
            os.close(self._host_mntns)
        _remove_cgroup(self._cgroup)
        _remove_cgroup(self._memcg)
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
        sb_dir.mkdir()
        namespaces: dict[int, int] = {}  # CLONE_NEW* -> an fd on the sandbox's namespace
        memcg, workspace, mounted = None, None, False
        try:
            if self._tmpfs:  # the sandbox's whole writable state, capped: upper dir and /tmp
                mount_tmpfs(sb_dir, self.disk_limit_mb)
                mounted = True
            (sb_dir / "tmp" / "crr-sandbox" / "home").mkdir(parents=True)
            if self._memcg is not None:
                memcg = _memory_cgroup(self._memcg / f"sb-{k}", self._limits[0])
            if self._netns:  # named even when recording: the spawner thread sits in the last one it made
                namespaces[_CLONE_NEWNET] = (_host_netns() if self.record_http
                                             else self._spawner.submit(_new_netns).result())
            workspace = make_workspace(sb_dir / "ws")
            if self._root is not None:
                binds = [("rw", str(workspace.tree), FIXED_REPO_DIR), ("rw", str(sb_dir / "tmp"), "/tmp")]
                if environment is not None:  # at ENV_ROOT, and at its own path, which its venv's scripts name
                    binds += [("ro", str(environment), mirror.ENV_ROOT), ("ro", str(environment), str(environment))]
                if self.record_http:  # the host's network, and so its resolver
                    binds.append(("ro", "/etc/resolv.conf", "/etc/resolv.conf"))
                (sb_dir / "root").mkdir()
                namespaces[_CLONE_NEWNS] = self._spawner.submit(
                    _new_root, self._host_mntns, [*self._root, *binds], str(sb_dir / "root")).result()
        except BaseException:
            _dispose(sb_dir, workspace, namespaces, memcg, mounted)
            raise
        sb = LocalSandbox(self, task, workspace, sb_dir, namespaces, memcg, mounted, environment)
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

    def _popen(self, command: str, namespaces: dict[int, int], memcg: Path | None, **kwargs) -> subprocess.Popen:
        """Start `bash -c command` from the spawner thread, in the pids cgroup, the sandbox's memory
        cgroup and its network and mount (its root) namespaces.

        unshare's child, PID 1 of the new PID namespace, is a small sh that sets the rlimits and runs
        bash (as PID 1, bash would ignore even `kill -9 $$`). A wrapper rather than a preexec_fn
        lets Popen vfork: forking a trainer with gigabytes of resident memory costs tens of ms.
        """
        if "\0" in command:
            raise CRRError("a command cannot contain a NUL byte")
        mem_mb, fsize_mb = self._limits
        limits = f"ulimit -v {mem_mb * 1024}; ulimit -f {fsize_mb * 2048}; ulimit -c 0"
        init = f'{limits}; "$@"; exit $?' if self.enforced["pid_namespace"] else f'{limits}; exec "$@"'
        prefix = _ENTER if self._root is not None else self._unshare
        argv = [*prefix, "/bin/sh", "-c", init, "sh", "bash", "-c", command]
        future = self._spawner.submit(_spawn, namespaces, self._host_mntns, memcg, self._memcg, argv, **kwargs)
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
            future.add_done_callback(functools.partial(_kill_spawned, pid_namespace=self.enforced["pid_namespace"]))
            raise

    def _sandbox_root(self, rootfs: Path) -> tuple[list[tuple[str, str, str]] | None, int | None]:
        """The engine's part of every sandbox root (_root_plan) and an fd on the host's mount namespace,
        once a sandbox root was built and ran a command here; (None, None), with a warning, where not."""
        why = (f"no root filesystem at {rootfs} (scripts/build-base-image.sh)" if not (rootfs / "bin" / "sh").exists()
               else f"no pivot_root number for {platform.machine()}" if _SYS_PIVOT_ROOT is None
               else "no PID namespaces (not root?)" if not _pid_namespace() else None)
        if why:
            _warn_once(f"no sandbox root, {why}: local sandbox commands run on the host file system, at the "
                       "repository's host path")
            return None, None
        host = None
        try:
            plan = _root_plan(rootfs)
            host = self._spawner.submit(_own_fs_context).result()
            probe = self.dir / "root-probe"
            for d in (probe / "tb", probe / "tmp", probe / "root"):
                d.mkdir(parents=True)
            binds = [("rw", str(probe / "tb"), FIXED_REPO_DIR), ("rw", str(probe / "tmp"), "/tmp")]
            ns = self._spawner.submit(_new_root, host, [*plan, *binds], str(probe / "root")).result()
            try:
                ran = self._spawner.submit(_spawn, {_CLONE_NEWNS: ns}, host, None, None,
                                           [*_ENTER, "/bin/sh", "-c", "test -w / || echo ok"], cwd=FIXED_REPO_DIR,
                                           env={"PATH": _SYSTEM_PATH}, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True).result()
                out, err = ran.communicate(timeout=30)
            finally:
                os.close(ns)
            if out != "ok\n":
                raise OSError(f"a command in it said {(err or out).strip()[-300:]!r}")
            shutil.rmtree(probe)
            return plan, host
        except (OSError, subprocess.SubprocessError) as e:
            if host is not None:
                os.close(host)
            _warn_once(f"cannot make a sandbox root from {rootfs} here ({e}): local sandbox commands run on "
                       "the host file system, at the repository's host path")
            return None, None

    def _probe_tmpfs(self) -> bool:
        """Can sandboxes get a size-capped tmpfs (needs root)? Mounts one once."""
        probe = self.dir / "tmpfs-probe"
        probe.mkdir()
        try:
            mount_tmpfs(probe, 1)
            unmount(str(probe))
            return True
        except OSError as e:
            _warn_once(f"cannot mount a tmpfs ({e}): what a local sandbox writes is capped per file only")
            return False
        finally:
            probe.rmdir()

    def _memory_cgroup(self) -> Path | None:
        """This engine's memory cgroup (no limit of its own; each sandbox gets a capped child), or None."""
        if (root := _memory_cgroup_root()) is None:
            return None
        try:
            return _memory_cgroup(root / self.dir.name, None)
        except OSError as e:
            _warn_once(f"cannot make a memory cgroup under {root} ({e}): a local sandbox's memory is capped "
                       "per process only")
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
        if environment is not None:  # the task's own Python environment replaces crr's
            root = mirror.ENV_ROOT if fixed else str(environment)
            self._env.update(mirror.sandbox_env(root, self.repo_dir, record=engine.record_http))
        self._closed = False

    def exec(self, command: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> ExecResult:
        """Run `command` with bash in the repository root; `env` adds to or overrides the clean env."""
        self._check_open()
        start = time.monotonic()
        proc = self._engine._popen(command, self._namespaces, self._memcg, cwd=self.repo_dir, env={**self._env, **(env or {})}, stdin=subprocess.DEVNULL,
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


def gc_leftovers(workdir: Path | None = None) -> list[str]:
    """Remove the mounts, dirs and (pids and memory) cgroups of local engines whose owning process is gone.

    Only crr's: an engine dir carries OWNER_FILE with its owner's pid and start time, so a live
    engine (or a reused pid) is never touched; an engine's cgroup is named after its dir and holds
    its owner's spawner thread for as long as the owner lives. Returns what was removed.
    """
    root = Path(workdir) if workdir else default_workdir()
    removed: list[str] = []
    roots = [r for r in (_pids_cgroup_root(), _memory_cgroup_root()) if r is not None]
    for cgroup in sorted(c for r in roots for c in r.glob(f"{_PREFIX}*")):
        try:
            owner_pid = cgroup.name.split("-")[2]
            if owner_pid in (cgroup / "cgroup.procs").read_text().split() or process_start(int(owner_pid)):
                continue  # the owner lives (its spawner thread is in it, or is joining it right now)
        except (OSError, IndexError, ValueError):
            continue
        # commands in flight when the owner died: before unmounting their cwd (a sandbox's memory
        # cgroup is a child of its engine's)
        for child in [*(c for c in cgroup.iterdir() if c.is_dir()), cgroup]:
            _kill_cgroup(child)
            _remove_cgroup(child)
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


def _dispose(sb_dir: Path, workspace: Workspace | None, namespaces: dict[int, int], memcg: Path | None,
             mounted: bool) -> None:
    """Take a sandbox's pieces down (those it got): its processes are gone by now."""
    for fd in namespaces.values():
        os.close(fd)  # a namespace goes with its last process and fd (its root's mounts with it)
    if workspace is not None:
        workspace.close()
    if mounted:
        unmount(str(sb_dir))
    shutil.rmtree(sb_dir, ignore_errors=True)
    _remove_cgroup(memcg)


def own_task(task: TaskSpec) -> bool:
    """Is `task` one of crr's own generated tasks (OWN_REPOS), with no environment of its own?"""
    repo = getattr(task, "repo", "")
    return (any(repo == r or (r.endswith("/") and repo.startswith(r)) for r in OWN_REPOS)
            and not task.mirror and not task.image)


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


def _spawn(namespaces: dict[int, int], host_mntns: int | None, memcg: Path | None, home: Path | None,
           argv: list[str], **kwargs) -> subprocess.Popen:
    """On the spawner thread: enter the sandbox's namespaces and memory cgroup, then start the command
    there (born in the cgroup: none of its memory is charged elsewhere)."""
    if memcg is not None:  # first: the sandbox's root has no /sys
        _join_thread(memcg)
    try:
        for kind, fd in namespaces.items():
            _check(_libc.setns(fd, kind))
        try:
            return subprocess.Popen(argv, **kwargs)
        finally:
            # Leave the sandbox's mount namespace at once: the thread must not be what keeps a closed
            # sandbox's root alive (its teardown would land on the next restore).
            if _CLONE_NEWNS in namespaces:
                _check(_libc.setns(host_mntns, _CLONE_NEWNS))
    finally:
        if memcg is not None:  # back to the engine's: the sandbox's cgroup must be removable at its close
            _join_thread(home)


def _check(ret: int) -> None:
    if ret != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _memory_cgroup(path: Path, limit_mb: int | None) -> Path:
    """Make the memory cgroup `path`, capped at `limit_mb` (memory and memory+swap) when given."""
    path.mkdir()
    try:
        if limit_mb is not None:
            (path / "memory.limit_in_bytes").write_text(str(limit_mb << 20))
            if (path / "memory.memsw.limit_in_bytes").exists():  # else swap could hold the excess
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_mb << 20))
    except OSError:
        path.rmdir()
        raise
    return path


@functools.cache
def _memory_cgroup_root() -> Path | None:
    """The dir under which each engine gets a memory cgroup, or None: a `crr` child of this process's
    own (cgroup v1) memory cgroup, so whatever limits this process keeps holding its sandboxes too.

    cgroup v1 only, like the pids cgroup: a single thread (the spawner) moves between cgroups.
    """
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line.split(":", 2)[2].strip() for line in f if line.split(":")[1] == "memory")
        root = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / "crr"
        root.mkdir(exist_ok=True)
        return root
    except (OSError, StopIteration) as e:
        _warn_once(f"no writable cgroup-v1 memory hierarchy ({e or 'not mounted'}): a local sandbox's memory "
                   "is capped per process only")
        return None


def _root_plan(rootfs: Path) -> list[tuple[str, str, str]]:
    """The engine's part of every sandbox root, as (kind, source, path in the root) steps for _new_root:
    the root filesystem's top-level entries (its symlinks, its dirs bound read-only, empty ones made),
    then crr's interpreter and venv read-only at their paths (a venv known by a symlinked path there too).
    A top-level dir that would have to hold such a path it lacks (the root's empty /root) is left out."""
    interpreter = []
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix)):
        real = os.path.realpath(prefix)
        if real not in ("/", "/usr"):  # else a system interpreter: the root has its own
            interpreter += [("ro", real, at) for at in dict.fromkeys((real, prefix))]
    plan = []
    for entry in sorted(os.scandir(rootfs), key=lambda e: e.name):
        if entry.is_symlink():  # usrmerge: /bin -> usr/bin and the like
            plan.append(("symlink", os.readlink(entry.path), f"/{entry.name}"))
        elif entry.is_dir() and entry.name not in _ROOT_FRESH and not any(
                at.startswith(f"/{entry.name}/") and not os.path.isdir(rootfs / at.lstrip("/"))
                for _, _, at in interpreter):
            plan.append(("ro", entry.path, f"/{entry.name}") if os.listdir(entry.path) else ("dir", "", f"/{entry.name}"))
    return plan + interpreter


def _new_root(host: int, plan: list[tuple[str, str, str]], stage: str) -> int:
    """On the spawner thread: a mount namespace whose root is `plan` over a read-only tmpfs (mounted on
    the empty dir `stage`), with a minimal /dev and a /proc mount point; an fd on it.

    Made from the host's namespace, every mount private first (nothing propagates either way); after
    pivot_root the host's tree is detached, so nothing of it stays reachable from the namespace.
    """
    _check(_libc.setns(host, _CLONE_NEWNS))
    try:
        _check(_libc.unshare(_CLONE_NEWNS))
        ns = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            _mount("tmpfs", stage, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
            for kind, source, at in plan:
                path = stage + at
                if kind == "symlink":
                    os.symlink(source, path)
                    continue
                if kind != "dir" and os.path.isfile(source):   # a file bound over a file (/etc/resolv.conf)
                    if not os.path.lexists(path):
                        open(path, "w").close()
                else:
                    os.makedirs(path, exist_ok=True)
                if kind != "dir":
                    _mount(source, path, None, _MS_BIND)
                    if kind == "ro":
                        _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            dev = f"{stage}/dev"
            os.mkdir(dev)
            _mount("tmpfs", dev, "tmpfs", _MS_NOSUID, "size=64m,mode=0755")
            for name in _DEVICES:
                open(f"{dev}/{name}", "w").close()
                _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
            for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                                 ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
                os.symlink(target, f"{dev}/{name}")
            os.mkdir(f"{dev}/shm")
            os.mkdir(f"{stage}/proc")  # mounted by each command's unshare --mount-proc
            _mount(None, stage, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            os.chdir(stage)
            _check(_libc.syscall(_SYS_PIVOT_ROOT, b".", b"."))  # the old root ends up stacked under "."
            _check(_libc.umount2(b".", _MNT_DETACH))
            return ns
        except BaseException:
            os.close(ns)
            raise
    finally:
        _check(_libc.setns(host, _CLONE_NEWNS))  # back to the host's root and cwd


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                   data and data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _own_fs_context() -> int:
    """On the spawner thread: stop sharing cwd/root with the other threads (setns into a mount
    namespace requires it) and return an fd on the host's mount namespace."""
    _check(_libc.unshare(_CLONE_FS))
    return os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


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
