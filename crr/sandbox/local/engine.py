"""LocalEngine: the ForkEngine protocol over local sandboxes (package doc), and what it probes once when made."""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Self

from crr.errors import CRRError, SandboxError
from crr.sandbox import http, mirror
from crr.sandbox.base import Snapshot, TaskSpec
from crr.sandbox.checkout import base_checkout
from crr.sandbox.engines import Option
from crr.sandbox.local.cgroups import (_join_thread, _memory_cgroup, _memory_cgroup_root, _pids_cgroup_root,
                                       _remove_cgroup)
from crr.sandbox.local.common import (_CLONE_NEWNET, _CLONE_NEWNS, _ENTER, _PREFIX, _SYS_PIVOT_ROOT,
                                      _SYSTEM_PATH, DEFAULT_ROOTFS, FIXED_REPO_DIR, OWNER_FILE, _warn_once,
                                      default_workdir, own_task)
from crr.sandbox.local.containment import (_host_netns, _kill_spawned, _new_netns, _new_root, _own_fs_context,
                                           _pid_namespace, _root_plan, _spawn, RootPlan)
from crr.sandbox.local.reclaim import _dispose
from crr.sandbox.local.sandbox import LocalSandbox
from crr.sandbox.overlay import (CopyWorkspace, Layer, OverlayWorkspace, mount_tmpfs, overlay_unavailable,
                                 process_start, unmount)

log = logging.getLogger(__name__)


_live: set[LocalEngine] = set()  # strong: an engine left unclosed still holds mounts until exit


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
    # What each option takes (crr.sandbox.engines checks them before anything starts).
    OPTIONS: ClassVar[dict[str, Option]] = {
        "workdir": Option(Path, none=True), "overlay": Option(bool, none=True),
        "mem_limit_mb": Option(int, least=1, note="MB"), "fsize_limit_mb": Option(int, least=1, note="MB"),
        "disk_limit_mb": Option(int, least=1, note="MB"), "pids_limit": Option(int, least=1),
        "rootfs": Option(Path, none=True), "trust_task_code": Option(bool), "record_http": Option(bool)}

    def __init__(self, workdir: Path | None = None, overlay: bool | None = None, mem_limit_mb: int = 2048,
                 fsize_limit_mb: int = 1024, disk_limit_mb: int = 1024, pids_limit: int = 1024,
                 rootfs: Path | None = None, trust_task_code: bool = False, record_http: bool = False):
        self.record_http = record_http
        self.workdir = Path(workdir) if workdir else default_workdir()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CRRError(f"fork engine 'local' workdir {str(self.workdir)!r}: cannot make it "
                           f"({e.strerror or e})") from None
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
                    _new_root, self._host_mntns, self._root.with_binds(binds), str(sb_dir / "root")).result()
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

    def _sandbox_root(self, rootfs: Path) -> tuple[RootPlan | None, int | None]:
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
            ns = self._spawner.submit(_new_root, host, plan.with_binds(binds), str(probe / "root")).result()
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


@atexit.register
def _close_all() -> None:
    for engine in list(_live):
        engine.close()
