"""What holds a local sandbox's commands: its root (a mount namespace built once with mount(2) and
pivot_root(2)), its network namespace, the spawn of a command into them, and the kill of a command's processes
at its end or timeout (package doc)."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import os
import selectors
import shutil
import signal
import site
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from crr.sandbox.base import BoundedOutput
from crr.sandbox.local.cgroups import _join_thread
from crr.sandbox.local.common import (_CLONE_FS, _CLONE_NEWNET, _CLONE_NEWNS, _DEVICES, _GRACE_S, _IFF_UP,
                                      _MNT_DETACH, _MS_BIND, _MS_NODEV, _MS_NOSUID, _MS_PRIVATE, _MS_RDONLY,
                                      _MS_REC, _MS_REMOUNT, _ROOT_FRESH, _SIOCSIFFLAGS, _SYS_PIVOT_ROOT,
                                      _warn_once)

log = logging.getLogger(__name__)


_libc = ctypes.CDLL(None, use_errno=True)


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


# (kind, source, path in the root): a step of _new_root's plan; kind is ro, rw (bound), dir (made), symlink, or null
# (os.devnull bound over a file, which then reads as empty)
Step = tuple[str, str, str]


@dataclass(frozen=True)
class RootPlan:
    """The engine's part of every sandbox root: the root filesystem's top-level entries, and crr's interpreter
    and venv read-only at their paths."""
    entries: list[Step]
    interpreter: list[Step]

    def with_binds(self, binds: list[Step]) -> list[Step]:
        """A sandbox's whole plan: the entries, the sandbox's own binds (its /testbed, its private /tmp), then
        the interpreter, so that an interpreter under one of those paths (a checkout under /tmp) is bound on
        top of the sandbox's dir, not hidden by it: else its commands would find the root's own python3."""
        return [*self.entries, *binds, *self.interpreter]


def _root_plan(rootfs: Path) -> RootPlan:
    """The engine's part of every sandbox root, as steps for _new_root: the root filesystem's top-level
    entries (its symlinks, its dirs bound read-only, empty ones made), and crr's interpreter and venv read-only
    at their paths (a venv known by a symlinked path there too). A top-level dir that would have to hold such a
    path it lacks (the root's empty /root) is left out."""
    interpreter = []
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix)):
        real = os.path.realpath(prefix)
        if real not in ("/", "/usr"):  # else a system interpreter: the root has its own
            interpreter += [("ro", real, at) for at in dict.fromkeys((real, prefix))]
    # crr's own editable install is not the task's environment: setuptools' `__editable__` .pth would import its
    # finder (pathlib, re, ...) at every Python start in a sandbox, 25-35 ms of a 55-60 ms start, and point at a
    # source tree the sandbox does not hold (crr cannot be imported there either way). It reads as empty there.
    venv = os.path.realpath(sys.prefix)
    hidden = [os.path.relpath(entry.path, venv)
              for site_dir in site.getsitepackages([venv]) if os.path.isdir(site_dir) for entry in os.scandir(site_dir)
              if entry.name.startswith("__editable__") and entry.name.endswith(".pth")]
    interpreter += [("null", os.devnull, os.path.join(at, rel)) for _, real, at in interpreter if real == venv
                    for rel in hidden]
    plan = []
    for entry in sorted(os.scandir(rootfs), key=lambda e: e.name):
        if entry.is_symlink():  # usrmerge: /bin -> usr/bin and the like
            plan.append(("symlink", os.readlink(entry.path), f"/{entry.name}"))
        elif entry.is_dir() and entry.name not in _ROOT_FRESH and not any(
                at.startswith(f"/{entry.name}/") and not os.path.isdir(rootfs / at.lstrip("/"))
                for _, _, at in interpreter):
            plan.append(("ro", entry.path, f"/{entry.name}") if os.listdir(entry.path)
                        else ("dir", "", f"/{entry.name}"))
    return RootPlan(plan, interpreter)


def _new_root(host: int, plan: list[Step], stage: str) -> int:
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
                if kind == "null" or (kind != "dir" and os.path.isfile(source)):  # over a file (/etc/resolv.conf)
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
