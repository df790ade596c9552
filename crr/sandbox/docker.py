"""Docker fork engines (paper: Preliminaries, "forkable at horizon h"; Appendix "Rollout-Dispatch
Cost Breakdown", where fork/materialisation is CRR's largest overhead, about 141 ms per fork).

The sandbox state is the repository at /testbed; tools are stateless per command. Two ways to fork it:

  commit   the paper's engine. snapshot = `docker commit` of the container into a labelled image,
           restore = a new container from that image. Exact for the whole container file system
           (installed packages too), but every fork pays a container start, and every generation adds
           an image layer, so long fork-of-fork chains are flattened (export + import) before
           overlay2's limit of about 125 layers.
  overlay  /testbed is a host overlayfs workspace (crr.sandbox.overlay) bind-mounted into a warm,
           pooled container. The pool's /testbed is fed from a host slot directory on a shared mount,
           so a workspace mounted onto the slot appears inside the already running container: a fork
           is a copy of the small upper layer plus two mounts, with no container start and no image.
           Only /testbed is forked; a container returns to the pool only if the rest of its file
           system is exactly as fresh (see fresh_state), else it is removed.

Commands do not go through `docker exec`: its runc round trip costs ~50 ms, more than a whole
overlay fork. PID 1 of every container is a small shell loop that runs action scripts handed to it
through a FIFO in a host directory bind-mounted at /run/crr, and streams their output back through
another FIFO (~10 ms an action). Every container has no network, memory/CPU/pid limits, and the labels
org.crr.owner=crr + engine id + owner pid, so `gc()` finds what crashed runs left, and only crr's.
What a container writes is capped, in both modes: every file at `fsize_limit_mb` (RLIMIT_FSIZE), the
log of PID 1's output (which a command can reach through /proc/1/fd/1) at 1 MB, /dev and /dev/shm at
Docker's 64 MB tmpfs each, the command channel at /run/crr (host side) on a tmpfs of CTL_TMPFS_MB (run
as root), and the rest as follows.

  overlay  the container's root is read-only. What stays writable is on tmpfs mounts the engine makes on
           the host: /testbed's workspace (per sandbox) and one scratch tmpfs per container bound at
           /tmp, HOME (/root) and /var/tmp, each at `disk_limit_mb` (ENOSPC past it). Writing anywhere
           else fails with EROFS, so `pip install` into the image's site-packages or /opt/crr/env is
           refused, as on the local engine. A container goes back to the pool only if all of it is as
           fresh as it started (_fresh_state).
  commit   the whole file system is the state (`docker commit` snapshots it), so the root stays
           writable. Where the storage driver takes a quota (`--storage-opt size=`: overlay2 on xfs with
           pquota) the writable layer gets one of `disk_limit_mb`. Elsewhere (overlay2 on ext4, as
           here) the engine, as root, watches the disk use of the container's upper dir and its
           /etc/hosts-like files while an action runs (every LAYER_POLL_S, or on a big layer 10x the
           last walk's cost up to 1 s: a walk costs ~5-20 us a file here; and when it ends, see
           _after_action): past `disk_limit_mb` it kills the action's processes from the host (a few
           ms) and the observation says "No space left on device". It overshoots by what the action
           writes in one poll interval plus the walk and the kill: 0.05 s x the write speed for a few
           big files (~0 here), up to ~1.5 s of writing for ~20,000 small ones (1.5-2.1x a 64 MB cap in
           4 KB files under load; docs/sandboxes.md has the figures). Until the layer is back under the cap, every action runs with RLIMIT_FSIZE 0,
           as on a full disk (deleting works, writing fails with "File too large"), and is stopped if it
           still adds more than _FULL_SLACK (empty files), so short actions cannot pile up past the cap.
           /tmp is a tmpfs of `disk_limit_mb` (never committed). The cap is per container, as a quota
           is: a snapshot's files move into its image, and a fork of it starts with an empty layer.
           Not root (the upper dir unreadable): the engine warns once and the layer is capped per file.

The one door is an engine made with `record_http=True` (the determinism filter's recording run,
crr.sandbox.http): its containers share the host's network and record their HTTP traffic.

A task with an environment (crr.sandbox.mirror) runs on a `crr-env:<key>` image instead of the base
image: the base plus /opt/crr (lock, wheelhouse, venv), installed by a container with no network.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import io
import itertools
import json
import logging
import os
import re
import select
import shlex
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

import docker
import docker.errors
import requests
from docker.types import LogConfig, Mount, Ulimit

from crr.errors import CRRError, SandboxError
from crr.sandbox import http, mirror
from crr.sandbox.base import BoundedOutput, ClosingSandbox, ExecResult, Snapshot, TaskSpec
from crr.sandbox.checkout import base_checkout, cache_root, publish
from crr.sandbox.overlay import Layer, OverlayWorkspace, mount_tmpfs, mounts_under, process_start, unmount

log = logging.getLogger(__name__)

REPO_DIR = "/testbed"
CTL_DIR = "/run/crr"  # in every container: the host side of the command channel
DEFAULT_BASE_IMAGE = "crr-base:bookworm"
SNAPSHOT_REPO, TASK_REPO, ENV_REPO = "crr-snap", "crr-task", "crr-env"
OWNER, ROLE, ENGINE, PID, PIDSTART, HOST, TASK = (
    f"org.crr.{k}" for k in ("owner", "role", "engine", "pid", "pidstart", "host", "task"))
# What every action sees on top of the image's environment (the same as the local engine's).
DEFAULT_ENV = {"TZ": "UTC", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
_GRACE_S = 10.0  # client-side guard: how long past its timeout an action may run before we step in
SCRATCH_DIRS = ("/tmp", "/root", "/var/tmp")  # overlay mode: the writable dirs of a read-only root (HOME is /root)
CTL_TMPFS_MB = 16  # the command channel's tmpfs (action scripts and exit statuses), as root
LAYER_POLL_S = 0.05  # commit mode without a quota: how often a running action's disk use is measured
# PID 1's stdout and stderr reach Docker's log on the host disk, and a command can write to them.
_LOG = LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"})
_INODE_BYTES = 256  # charged per file on top of its blocks, so that a million empty files count (ext4's inode)
_FULL_SLACK = 1 << 20  # commit mode, layer over the cap: what an action may still add (empty files) unstopped
_MEASURE_EVERY = 10  # commit mode, watched: the layer is walked after at most this many actions

# PID 1 serves actions: it reads an action id from the request FIFO (held open read-write, so that it
# never sees EOF) and runs that action's script with stdout on the action's `out` FIFO, then writes
# its exit status; the host reads `out` to EOF. Waiting for an action, dash's waitpid(-1) also reaps
# the orphans the kernel re-parents to PID 1, so killed trees leave no zombies against pids_limit.
_PID1 = ["sh", "-c", (f"cd /; exec 3<>{CTL_DIR}/req; while :; do if read -r id <&3; then "
                      f'd={CTL_DIR}/$id; {{ sh "$d/cmd" 2>"$d/err"; echo $? >"$d/rc"; }} >"$d/out"; fi; done')]

# One action, after `set -- TIMEOUT COMMAND`. Coreutils `timeout` bounds it (TERM, then KILL 2 s
# later). The command's stderr is joined to its stdout, so the action's stderr (`err`) carries only
# timeout's --verbose notice, which tells a timeout from a command that merely exits 124. Then every
# process but PID 1 is killed: nothing an action started (`sleep 100 &`, a daemon that called setsid)
# outlives it, and the output FIFO reaches EOF.
# SWE-bench images keep the project's environment in conda (env "testbed"), which only their eval scripts
# and interactive shells activate; the agent's `python -m pytest` needs it as much. Its bin first on PATH
# is the part of `conda activate` that matters here, without activate's fraction of a second per command.
TESTBED_ENV = "/opt/miniconda3/envs/testbed"
_ACTION = (f"cd {REPO_DIR} 2>&1 || exit 125\n"
           f'[ -d {TESTBED_ENV}/bin ] && export PATH="{TESTBED_ENV}/bin:$PATH" CONDA_PREFIX={TESTBED_ENV} '
           "CONDA_DEFAULT_ENV=testbed\n"
           'timeout --verbose -k 2 "$1" sh -c \'exec bash -c "$0" 2>&1\' "$2" </dev/null\n'
           "rc=$?; kill -9 -1 2>/dev/null; exit $rc\n")

_MS_BIND, _MS_SHARED = 0x1000, 0x100000
_libc = ctypes.CDLL(None, use_errno=True)


def docker_client() -> docker.DockerClient:
    """A client for the local daemon, or a SandboxError that says how to get one."""
    try:
        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except (docker.errors.DockerException, requests.RequestException, OSError) as e:
        raise SandboxError(f"the Docker daemon is not reachable ({e}); start it (dockerd) or use "
                           "--engine local") from None


@contextlib.contextmanager
def _docker_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (docker.errors.DockerException, requests.RequestException) as e:
        raise SandboxError(f"docker could not {what}: {getattr(e, 'explanation', None) or e}") from None


def _owner_labels(engine_id: str) -> dict[str, str]:
    pid = os.getpid()
    return {OWNER: "crr", ENGINE: engine_id, PID: str(pid), PIDSTART: process_start(pid) or "",
            HOST: socket.gethostname()}


def _owner_alive(labels: dict) -> bool:
    """Whether the process that made a crr-labelled thing may still use it (unknown counts as alive)."""
    if labels.get(HOST) != socket.gethostname() or not labels.get(PID, "").isdigit():
        return True
    start = process_start(int(labels[PID]))
    return start is not None and start == (labels.get(PIDSTART) or start)


def _mount_call(source: str | None, target: str, flags: int) -> None:
    # mount(2) directly, as crr.sandbox.overlay does: spawning mount(8) would cost ~5 ms a fork.
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"mount (flags {flags:#x}) of {source} on {target} failed: {os.strerror(err)}; "
                           "the overlay mode needs root; use the commit mode otherwise")


def _dispose_root(root: Path) -> None:
    """Unmount everything under an engine's host directory, then delete it (never through a mount)."""
    for point in mounts_under(root):
        unmount(point)
    if mounts_under(root):
        log.warning("%s still has mounts; left it in place", root)
    else:
        shutil.rmtree(root, ignore_errors=True)


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


@dataclass
class _Container:
    """A running container and the host end of its command channel."""

    id: str
    name: str
    ctl: Path                      # host dir at /run/crr: the request FIFO and one dir per action
    slot: Path | None = None       # overlay mode: the host dir behind /testbed
    scratch: Path | None = None    # overlay mode: the host tmpfs behind /tmp, /root and /var/tmp
    pid: int = 0                   # PID 1 on the host, for /proc/<pid>/root (overlay mode: from the start)
    upper: str = ""                # overlay mode: its writable layer, and the container's state when fresh
    fresh: tuple = ()
    watch: tuple[str, ...] = ()    # commit mode without a quota: the paths whose disk use is capped


class DockerSandbox(ClosingSandbox):
    """One container whose /testbed holds the task's repository; see the module doc."""

    repo_dir = REPO_DIR

    def __init__(self, engine: DockerEngine, task: TaskSpec, box: _Container, image: str, depth: int = 0,
                 snapshot_id: str | None = None, workspace: OverlayWorkspace | None = None):
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

    # -- the disk cap of a watched layer (commit mode without a quota; module doc) -----------------

    def _measure(self) -> int:
        """The watched paths' disk use in bytes, now."""
        self.disk_used = _disk_use(self.box.watch)
        self._written, self._unmeasured = _written(self._pid1()), 0
        return self.disk_used

    def _after_action(self, cap: int, stopped: bool) -> int:
        """The watched use once an action ended: measured (a walk costs ~5-20 us a file of the layer),
        unless the container's processes cannot have written enough since the last measurement to pass
        the cap. Their bytes written come from PID 1's /proc io, which folds in every process it reaped
        (the action's, and the orphans it started); what that does not count (empty files and dirs,
        Docker's own writes, an orphan killed but not yet reaped) is measured by the walk at least every
        _MEASURE_EVERY actions, and by the polls of any action longer than LAYER_POLL_S."""
        self._unmeasured += 1
        if (stopped or self.disk_used > cap or self._unmeasured >= _MEASURE_EVERY
                or self.disk_used + _written(self._pid1()) - self._written > cap):
            return self._measure()
        return self.disk_used

    def _disk_full_notice(self, stopped: bool) -> bytes:
        what = ("the command was stopped" if stopped else
                "until it is back under the cap, files can be deleted, not written")
        return (f"\n[crr: No space left on device: this sandbox has written {self.disk_used / 2**20:.0f} MB outside "
                f"/tmp, past its disk cap of {self.engine.disk_limit_mb} MB; {what}]\n").encode()

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


@dataclass
class _Held:
    """A snapshot this engine holds: its image (commit) or overlay layer, and who still needs it."""

    task: TaskSpec
    image: str           # commit: the snapshot image; overlay: the image the pool runs
    depth: int = 0       # commit: image layers, for the flatten guard
    layer: Layer | None = None
    users: int = 0       # open sandboxes restored from it
    released: bool = False


class DockerEngine:
    """Fork engine over Docker containers; `mode` picks commit or overlay snapshots (module doc).

    image: the base image for tasks without their own (default $CRR_BASE_IMAGE or crr-base:bookworm).
    pool_size: overlay mode, warm containers kept ready per image.
    fsize_limit_mb: any one file; disk_limit_mb: /tmp, the overlay workspace and, where the storage
    driver takes a quota, the writable layer (module doc).
    record_http: containers get the host's network and record HTTP (module doc).
    """

    name = "docker"

    def __init__(self, mode: Literal["commit", "overlay"] = "commit", image: str | None = None,
                 mem_limit: str = "2g", cpus: float = 1.0, pids_limit: int = 512,
                 fsize_limit_mb: int = 1024, disk_limit_mb: int = 1024,
                 flatten_depth: int = 100, pool_size: int = 2, record_http: bool = False):
        if mode not in ("commit", "overlay"):
            raise CRRError(f"unknown docker fork mode {mode!r}; choose commit or overlay")
        if not 2 <= flatten_depth <= 120:
            raise CRRError(f"flatten_depth must be between 2 and 120 (overlay2 fails near 125 layers), "
                           f"got {flatten_depth}")
        self.mode, self.mem_limit, self.cpus, self.pids_limit = mode, mem_limit, cpus, pids_limit
        self.flatten_depth, self.pool_size = flatten_depth, max(0, pool_size)
        self.fsize_limit_mb, self.disk_limit_mb = fsize_limit_mb, disk_limit_mb
        self._layer_quota: bool | None = None  # does the storage driver take --storage-opt size=? (first start)
        self._warned_unwatched = False  # commit mode, no quota, not root: said once
        self._docker_root: str | None = None  # the daemon's directory (commit mode's disk watch)
        self.record_http = record_http
        self.base_image = image or os.environ.get("CRR_BASE_IMAGE", DEFAULT_BASE_IMAGE)
        self.client = docker_client()
        self.api = self.client.api
        self.id = uuid.uuid4().hex[:10]
        self.labels = _owner_labels(self.id)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._sandboxes: dict[str, DockerSandbox] = {}
        self._held: dict[str, _Held] = {}
        self._warm: dict[str, deque[Future]] = {}  # overlay mode: image -> ready (or starting) containers
        self._background = ThreadPoolExecutor(1, thread_name_prefix=f"crr-{self.id}")
        self._closed = False
        self.root = self._make_root()
        atexit.register(self.close)  # an interrupted run still removes what it made

    # -- the ForkEngine protocol -----------------------------------------------------------------

    def start(self, task: TaskSpec) -> DockerSandbox:
        """A fresh sandbox with the task's repository at base_commit in /testbed."""
        self._check_open()
        if self.mode == "commit":
            image = self._task_image(task)
            sb = self._commit_sandbox(task, image, depth=self._layers(image))
        else:
            image = task.image or self._env_image(task)
            self._require_image(image, task)
            lower = self._image_testbed(image) if task.image else base_checkout(task)
            sb = self._overlay_sandbox(task, image, lambda root: OverlayWorkspace(root, lower))
        return http.install_cassette(sb, self.record_http)

    def restore(self, snapshot: Snapshot) -> DockerSandbox:
        """An independent sandbox in exactly the state `snapshot` was taken in."""
        self._check_open()
        with self._lock:
            held = self._held.get(snapshot.id)
            if held is None or held.released:
                raise CRRError(f"snapshot {snapshot.id} is not held by this docker engine "
                               "(released, or taken by another engine)")
            held.users += 1
        try:
            if self.mode == "commit":
                return self._commit_sandbox(held.task, held.image, held.depth, snapshot.id)
            return self._overlay_sandbox(held.task, held.image,
                                         lambda root: OverlayWorkspace.restore(held.layer, root), snapshot.id)
        except BaseException:
            self._unuse(snapshot.id)
            raise

    def release(self, snapshot: Snapshot) -> None:
        """Drop a snapshot; its image or layer goes once the last sandbox restored from it closes."""
        with self._lock:
            held = self._held.get(snapshot.id)
            if held is None or held.released:
                return
            held.released = True
        self._unuse(snapshot.id, drop=0)

    def close(self) -> None:
        """Remove every container, snapshot image, mount and temp dir this engine made; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            for sb in list(self._sandboxes.values()):
                try:
                    sb.close()
                except Exception as e:  # noqa: BLE001 - keep removing the rest
                    log.warning("closing %s: %s", sb.name, e)
            for sid in list(self._held):
                self.release(Snapshot(sid, self.name, ""))
        finally:
            self._background.shutdown(wait=True)  # pending starts, recycles and removals finish first
            for queue in self._warm.values():
                for fut in queue:
                    if fut.exception() is None:
                        self._discard(fut.result())
            self._sweep()
            _dispose_root(self.root)

    def _sweep(self) -> None:
        """Remove whatever still carries this engine's label (a start or commit cut short by an
        interrupt, say): nothing outlives its owner."""
        label = f"{ENGINE}={self.id}"
        try:
            for c in self.api.containers(all=True, filters={"label": label}):
                self.api.remove_container(c["Id"], force=True)
            _remove_images(self.api, self.api.images(all=True, filters={"label": [label, f"{ROLE}=snapshot"]}))
        except (docker.errors.DockerException, requests.RequestException) as e:
            log.warning("engine %s: could not remove all its leftovers (%s); crr sandbox gc will", self.id, e)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- images ---------------------------------------------------------------------------------

    def _require_image(self, image: str, task: TaskSpec) -> dict:
        with _docker_errors(f"inspect image {image}"):
            try:
                return self.api.inspect_image(image)
            except docker.errors.ImageNotFound:
                how = ("build it with scripts/build-base-image.sh" if image == self.base_image
                       else f"it is task {task.instance_id}'s image: build or load it on this machine")
                raise SandboxError(f"Docker image {image} is not present; {how} (crr never pulls images)") from None

    def _layers(self, image: str) -> int:
        with _docker_errors(f"inspect image {image}"):
            return len(self.api.inspect_image(image)["RootFS"]["Layers"])

    def _task_image(self, task: TaskSpec) -> str:
        """The image a commit-mode sandbox of `task` starts from: the task's own image, or the base
        (or env) image plus the base checkout at /testbed, committed once as a cached `crr-task:<key>`."""
        if task.image:
            self._require_image(task.image, task)
            return task.image
        base = self._env_image(task)
        base_id = self._require_image(base, task)["Id"]
        checkout = base_checkout(task)
        # Keyed by content (base image, commit), so tasks and runs with the same commit share it.
        key = hashlib.sha256(f"{base_id}\0{task.base_commit}".encode()).hexdigest()[:16]
        tag = f"{TASK_REPO}:{key}"
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.api.inspect_image(tag)
            return tag
        log.info("building %s for task %s from %s", tag, task.instance_id, checkout)
        with _docker_errors(f"build the image of task {task.instance_id}"):
            container = self.client.containers.create(base, entrypoint=["true"], network_mode="none",
                                                      labels={**self.labels, ROLE: "build"})
            try:  # a container that never starts takes the files, and commit makes them an image
                with tempfile.TemporaryFile() as buf:
                    with tarfile.open(fileobj=buf, mode="w") as tar:
                        tar.add(checkout, arcname=REPO_DIR.lstrip("/"), filter=_root_owned)
                    buf.seek(0)
                    container.put_archive("/", buf)
                container.commit(TASK_REPO, key, changes=[f"WORKDIR {REPO_DIR}", *_label_changes(
                    {ROLE: "task", TASK: task.instance_id})])
            finally:
                container.remove(force=True)
        return tag

    def _env_image(self, task: TaskSpec) -> str:
        """The image for a task's sandboxes (before /testbed): the base image, or for a task with an
        environment the base plus /opt/crr installed from the wheelhouse with no network, committed
        once as a cached `crr-env:<key>` (keyed by the base image and the environment)."""
        if not task.mirror:
            return self.base_image
        lines = task.mirror["requirements"]
        base_id = self._require_image(self.base_image, task)["Id"]
        key = hashlib.sha256(f"{base_id}\0{mirror.environment_key(lines)}".encode()).hexdigest()[:16]
        tag = f"{ENV_REPO}:{key}"
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.api.inspect_image(tag)
            return tag
        log.info("building %s (lock %s) for task %s", tag, mirror.digest(lines)[:12], task.instance_id)
        script = mirror.install_script(mirror.ENV_ROOT, "/usr/bin/python3")
        with tempfile.TemporaryDirectory() as staged, _docker_errors(f"build the environment of task "
                                                                     f"{task.instance_id}"):
            mirror.stage(lines, Path(staged) / "crr")
            container = self.client.containers.create(self.base_image, entrypoint=["bash", "-c", script],
                                                      network_mode="none", labels={**self.labels, ROLE: "build"})
            try:
                with tempfile.TemporaryFile() as buf:
                    with tarfile.open(fileobj=buf, mode="w") as tar:
                        tar.add(Path(staged) / "crr", arcname=mirror.ENV_ROOT.lstrip("/"), filter=_root_owned)
                    buf.seek(0)
                    container.put_archive("/", buf)
                container.start()
                status = container.wait(timeout=mirror.PIP_TIMEOUT_S)["StatusCode"]
                if status != 0:
                    logs = container.logs().decode("utf-8", errors="replace")
                    raise SandboxError(f"installing the environment of task {task.instance_id} in {self.base_image} "
                                       f"failed (exit {status}):\n{logs[-2000:]}")
                container.commit(ENV_REPO, key, changes=_label_changes({ROLE: "task", TASK: task.instance_id}))
            finally:
                container.remove(force=True)
        return tag

    def _image_testbed(self, image: str) -> Path:
        """/testbed of an image, extracted once into the cache: the overlay lower dir of a task that
        comes as an image."""
        image_id = self.api.inspect_image(image)["Id"].split(":")[-1][:16]
        dest = cache_root() / "docker-testbed" / image_id
        if dest.is_dir():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{image_id}."))
        try:
            with _docker_errors(f"read {REPO_DIR} from image {image}"):
                container = self.client.containers.create(image, entrypoint=["true"], network_mode="none",
                                                          labels={**self.labels, ROLE: "build"})
                try:
                    stream, _ = container.get_archive(REPO_DIR)
                    # GNU tar rather than tarfile: it keeps owners, modes, links and special files
                    # exactly, and takes the stream as it arrives.
                    tar = subprocess.Popen(["tar", "-x", "-p", "--same-owner", "-C", str(tmp)],
                                           stdin=subprocess.PIPE, stderr=subprocess.PIPE)
                    for chunk in stream:
                        tar.stdin.write(chunk)
                    _, err = tar.communicate()
                    if tar.returncode != 0:
                        raise SandboxError(f"extracting {REPO_DIR} of {image} failed: {err.decode()[-300:]}")
                finally:
                    container.remove(force=True)
            publish(tmp / REPO_DIR.lstrip("/"), dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    # -- containers -------------------------------------------------------------------------------

    def _make_root(self) -> Path:
        """This engine's host directory (command channels; overlay: slots, workspaces, layers, scratch tmpfs).

        In overlay mode it is bind-mounted on itself and made a shared mount: Docker's `rslave`
        propagation needs its source on a shared (or slave) mount, the host's / is private here,
        and a crr-owned bind leaves everyone else's propagation as it was.
        """
        root = cache_root() / "docker" / f"crr-docker-{os.getpid()}-{self.id}"
        root.mkdir(parents=True)
        try:
            (root / "owner.json").write_text(json.dumps(self.labels))
            (root / "ctl").mkdir()
            if self.mode == "overlay":
                _mount_call(str(root), str(root), _MS_BIND)
                _mount_call(None, str(root), _MS_SHARED)
                for sub in ("slots", "ws", "layers", "scratch"):
                    (root / sub).mkdir()
        except BaseException:
            _dispose_root(root)
            raise
        return root

    def _run(self, image: str, labels: dict[str, str], slot: Path | None = None) -> _Container:
        """Create and start a locked-down container from a local image (create never pulls). With a
        `slot` (overlay mode) its root is read-only and what stays writable is a capped tmpfs (module doc)."""
        name = f"crr-{self.id}-{next(self._seq)}"
        box = _Container("", name, self.root / "ctl" / name, slot)
        fsize = self.fsize_limit_mb << 20
        try:
            box.ctl.mkdir()
            mounts = [Mount(CTL_DIR, str(box.ctl), type="bind")]
            tmpfs = {"/tmp": f"size={self.disk_limit_mb}m,mode=1777,exec"}  # commit mode: never committed
            if os.geteuid() == 0:  # not in commit mode run by a user: the disk watch needs root too
                mount_tmpfs(box.ctl, CTL_TMPFS_MB)
            if slot is not None:
                box.scratch = self.root / "scratch" / name
                box.scratch.mkdir()
                mount_tmpfs(box.scratch, self.disk_limit_mb)
                for path, host in _scratch_dirs(box):
                    host.mkdir()
                    host.chmod(0o700 if path == "/root" else 0o1777)
                    mounts.append(Mount(path, str(host), type="bind"))
                mounts.append(Mount(REPO_DIR, str(slot), type="bind", propagation="rslave"))
                tmpfs = {}
            os.mkfifo(box.ctl / "req")
            settings = dict(entrypoint=_PID1, command=[], name=name, labels={**self.labels, **labels},
                            working_dir=REPO_DIR, network_mode="host" if self.record_http else "none",
                            mem_limit=self.mem_limit, nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids_limit,
                            mounts=mounts, ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize)],
                            tmpfs=tmpfs, read_only=slot is not None, log_config=_LOG)
            with _docker_errors(f"start a container from {image}"):
                container = self._create(image, settings)
                box.id = container.id
                if slot is None:
                    box.watch = self._watched(container)
                container.start()
                self._wait_for_pid1(box)
                if slot is not None:
                    attrs = self.api.inspect_container(container.id)
                    box.pid, box.upper = attrs["State"]["Pid"], attrs["GraphDriver"]["Data"].get("UpperDir", "")
                    box.fresh = _fresh_state(box)
        except BaseException:
            self._discard(box)
            raise
        return box

    def _create(self, image: str, settings: dict):
        """Create a container; in commit mode with a quota on its writable layer where the storage
        driver takes one (asked once: the daemon refuses `size` unless overlay2 sits on xfs with pquota)."""
        if self.mode == "commit" and self._layer_quota is not False:
            try:
                container = self.client.containers.create(
                    image, storage_opt={"size": f"{self.disk_limit_mb}M"}, **settings)
                self._layer_quota = True
                return container
            except docker.errors.APIError as e:
                if self._layer_quota or "storage-opt" not in str(e).lower():
                    raise
                self._layer_quota = False
                log.info(f"the Docker storage driver takes no quota here ({e.explanation or e}): the engine "
                         f"watches each container's writable layer instead (cap {self.disk_limit_mb} MB)")
        return self.client.containers.create(image, **settings)

    def _watched(self, container) -> tuple[str, ...]:
        """Commit mode: the paths the disk watch measures (module doc): the container's upper dir and
        the /etc/hosts-like files Docker binds in from its own directory. None where a quota caps the
        layer, or where the layer cannot be read (not root: warned once)."""
        upper = container.attrs["GraphDriver"]["Data"].get("UpperDir", "")
        if self._layer_quota:
            return ()
        if not (upper and os.access(upper, os.R_OK | os.X_OK)):
            if not self._warned_unwatched:
                self._warned_unwatched = True
                log.warning(f"the writable layers of this docker engine's containers cannot be watched "
                            f"({upper or 'no upper dir'} is not readable: run as root): they are capped per file "
                            f"({self.fsize_limit_mb} MB) only; their /tmp at {self.disk_limit_mb} MB")
            return ()
        if self._docker_root is None:
            with _docker_errors("ask the daemon for its root directory"):
                self._docker_root = self.client.info()["DockerRootDir"]
        own = f"{self._docker_root}/containers/{container.id}"
        return upper, f"{own}/hosts", f"{own}/hostname", f"{own}/resolv.conf"

    def _wait_for_pid1(self, box: _Container, limit_s: float = 30.0) -> None:
        """Return once PID 1 holds the request FIFO (open() fails with ENXIO until it does)."""
        deadline, next_check = time.monotonic() + limit_s, time.monotonic() + 1.0
        while True:
            try:
                os.close(os.open(box.ctl / "req", os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
                return
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            if time.monotonic() > next_check:  # a PID 1 that died (no sh in the image?) won't come
                state = self.api.inspect_container(box.id)["State"]
                if not state["Running"] or time.monotonic() > deadline:
                    logs = self.api.logs(box.id, tail=5).decode(errors="replace").strip()
                    raise SandboxError(f"container {box.name} did not come up ({state['Status']}); "
                                       f"its image needs /bin/sh; log: {logs or '(empty)'}")
                next_check = time.monotonic() + 1.0
            time.sleep(0.002)

    def _discard(self, box: _Container) -> None:
        if box.id:
            try:
                self.api.remove_container(box.id, force=True)
            except docker.errors.NotFound:
                pass
            except (docker.errors.DockerException, requests.RequestException) as e:
                log.warning("could not remove container %s: %s (crr sandbox gc will)", box.name, e)
        for tmpfs in (box.ctl, box.scratch):  # tmpfs mounts where crr runs as root
            if tmpfs is not None:
                if os.path.ismount(tmpfs):
                    unmount(str(tmpfs))
                shutil.rmtree(tmpfs, ignore_errors=True)
        if box.slot is not None:
            with contextlib.suppress(OSError):
                box.slot.rmdir()

    def _register(self, sb: DockerSandbox) -> DockerSandbox:
        with self._lock:
            self._sandboxes[sb.name] = sb
        return sb

    def _close_sandbox(self, sb: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.pop(sb.name, None)
        try:
            if sb.workspace is None:
                self._discard(sb.box)
            else:
                # The slot first: it is all the container sees of the workspace, and no process holds
                # it (actions leave none behind; PID 1 sits in /).
                unmount(str(sb.box.slot))
                sb.workspace.close()
                _dispose_root(sb.workspace.root.parent)  # its tmpfs
                self._background.submit(self._recycle, sb.image, sb.box)
        finally:
            if sb.snapshot_id is not None:
                self._unuse(sb.snapshot_id)

    # -- commit mode ------------------------------------------------------------------------------

    def _commit_sandbox(self, task: TaskSpec, image: str, depth: int, snapshot_id: str | None = None
                        ) -> DockerSandbox:
        box = self._run(image, {ROLE: "sandbox", TASK: task.instance_id})
        return self._register(DockerSandbox(self, task, box, image, depth=depth, snapshot_id=snapshot_id))

    def _snapshot(self, sb: DockerSandbox) -> Snapshot:
        sid = f"{self.id}-{next(self._seq)}"
        if self.mode == "commit":
            held = _Held(sb.task, f"{SNAPSHOT_REPO}:{sid}")
            labels = _label_changes({**self.labels, ROLE: "snapshot", TASK: sb.task.instance_id})
            if sb.depth + 1 > self.flatten_depth:
                self._flatten(sb, sid, labels)
            else:
                with sb._call("commit the container"):
                    self.api.commit(sb.box.id, SNAPSHOT_REPO, sid, changes=labels)
            held.depth = self._layers(held.image)
            handle = {"image": held.image, "depth": held.depth}
        else:
            held = _Held(sb.task, sb.image, layer=sb.workspace.snapshot(self.root / "layers" / sid))
            handle = {"layer": str(held.layer.path), "image": sb.image}
        with self._lock:
            self._held[sid] = held
        return Snapshot(id=sid, engine=self.name, task_id=sb.task.instance_id, handle=handle)

    def _flatten(self, sb: DockerSandbox, sid: str, labels: list[str]) -> None:
        """Export the container's file system and import it as a one-layer image, keeping its
        environment and workdir: the cure for overlay2's ~125-layer limit on commit chains."""
        log.info("flattening %s (%d layers) into %s:%s", sb.name, sb.depth, SNAPSHOT_REPO, sid)
        with sb._call("flatten the container"):
            env = self.api.inspect_container(sb.box.id)["Config"].get("Env") or []
            changes = [f"ENV {k}={json.dumps(v)}" for k, _, v in (e.partition("=") for e in env)]
            self.api.import_image_from_data(self.api.export(sb.box.id), repository=SNAPSHOT_REPO,
                                            tag=sid, changes=[*changes, f"WORKDIR {REPO_DIR}", *labels])

    def _unuse(self, sid: str, drop: int = 1) -> None:
        """A sandbox restored from `sid` closed (drop=1) or `sid` was released (drop=0): free the
        snapshot's image or layer once it is released and unused."""
        with self._lock:
            held = self._held.get(sid)
            if held is None:
                return
            held.users -= drop
            if not held.released or held.users > 0:
                return
            del self._held[sid]
        if held.layer is not None:
            held.layer.release()
            return
        try:  # by tag: a parent of a live child snapshot is only untagged, and pruned with the child
            self.api.remove_image(held.image)
        except (docker.errors.DockerException, requests.RequestException) as e:
            log.warning("could not remove snapshot image %s: %s (crr sandbox gc will)", held.image, e)

    # -- overlay mode -----------------------------------------------------------------------------

    def _overlay_sandbox(self, task: TaskSpec, image: str, make_workspace: Callable[[Path], OverlayWorkspace],
                         snapshot_id: str | None = None) -> DockerSandbox:
        box = self._take_warm(image)
        ws, scratch = None, self.root / "ws" / box.name
        try:
            scratch.mkdir()
            mount_tmpfs(scratch, self.disk_limit_mb)  # the workspace's writes, capped
            ws = make_workspace(scratch / "ws")
            # Mounted onto the slot, the workspace propagates into the running container's /testbed.
            _mount_call(str(ws.tree), str(box.slot), _MS_BIND)
        except BaseException:
            if ws is not None:
                ws.close()
            _dispose_root(scratch)
            self._background.submit(self._discard, box)
            raise
        return self._register(DockerSandbox(self, task, box, image, snapshot_id=snapshot_id, workspace=ws))

    def _take_warm(self, image: str) -> _Container:
        """A running container of `image` with an empty /testbed slot. The pool is topped up in the
        background, so that a fork waits for no container start."""
        with self._lock:
            queue = self._warm.setdefault(image, deque())
            fut = queue.popleft() if queue else self._background.submit(self._start_warm, image)
            if len(queue) < self.pool_size:
                self._background.submit(self._refill, image)
        try:
            return fut.result()
        except BaseException:  # interrupted while waiting: the container must not go astray
            fut.add_done_callback(lambda f: f.exception() or self._discard(f.result()))
            raise

    def _start_warm(self, image: str) -> _Container:
        slot = self.root / "slots" / uuid.uuid4().hex[:12]
        slot.mkdir()
        return self._run(image, {ROLE: "sandbox"}, slot=slot)

    def _refill(self, image: str) -> None:
        while not self._closed:
            with self._lock:
                if len(self._warm[image]) >= self.pool_size:
                    return
            box = self._start_warm(image)
            with self._lock:
                self._warm[image].append(_done(box))

    def _recycle(self, image: str, box: _Container) -> None:
        """Back into the pool if the container is still exactly fresh outside /testbed, else removed."""
        with self._lock:
            room = not self._closed and len(self._warm[image]) < 2 * self.pool_size
        try:
            clean = (room and self.api.inspect_container(box.id)["State"]["Pid"] == box.pid
                     and _fresh_state(box) == box.fresh)
        except (OSError, docker.errors.DockerException, requests.RequestException):  # it is gone
            clean = False
        if not clean:
            self._discard(box)
            return
        with self._lock:
            self._warm[image].append(_done(box))

    def _check_open(self) -> None:
        if self._closed:
            raise CRRError("this docker engine is closed")


def _done(box: _Container) -> Future:
    fut: Future = Future()
    fut.set_result(box)
    return fut


def _scratch_dirs(box: _Container) -> list[tuple[str, Path]]:
    """(path in the container, host dir) of each writable dir of an overlay-mode container's read-only root."""
    return [(path, box.scratch / path.strip("/").replace("/", "-")) for path in SCRATCH_DIRS]


def _fresh_state(box: _Container) -> tuple:
    """What must be as it started for an overlay-mode container to go back to the pool: its writable
    layer entry by entry (the root is read-only: checked all the same), each scratch dir, /dev,
    /dev/shm and /dev/mqueue (Docker's own tmpfs and mqueue mounts), and its command channel. A
    directory's ctime moves with every entry made, removed or renamed in it and every chmod or
    chown of it, and these start empty (/dev: only device nodes and links), so its stat is its state."""
    root = f"/proc/{box.pid}/root"
    dirs = [*(host for _, host in _scratch_dirs(box)), f"{root}/dev", f"{root}/dev/shm", f"{root}/dev/mqueue"]
    stats = [(st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_ctime_ns) for st in map(os.lstat, dirs)]
    with os.scandir(box.ctl) as entries:  # the host makes and removes action dirs here: only "req" stays
        channel = sorted((e.name, e.inode()) for e in entries)
    return _layer_state(box.upper), tuple(stats), tuple(channel)


def _disk_use(paths: tuple[str, ...]) -> int:
    """Bytes on disk of `paths` and everything under them (not following links): blocks allocated
    (ext4 counts delayed allocation) plus an inode each, so that empty files count too."""
    total, stack = 0, list(paths)
    while stack:
        path = stack.pop()
        try:
            entries = os.scandir(path)
        except NotADirectoryError:
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_blocks * 512 + _INODE_BYTES
            continue
        except OSError:  # gone (removed while we looked)
            continue
        with entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512 + _INODE_BYTES
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
    return total


def _written(pid: int) -> int:
    """Bytes `pid` and the children it reaped made dirty in the page cache of a disk (write_bytes of
    /proc/PID/io: tmpfs does not count); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return 0


def _kill_namespace(pid1: int, rounds: int = 50) -> bool:
    """SIGKILL, from the host, every process in the PID namespace of `pid1` but `pid1` itself (what
    `kill -9 -1` inside does), again until none is left (a fork may race the first pass); True once
    none is. False if the namespace cannot be read (PID 1 gone, or not root)."""
    try:
        ns = os.readlink(f"/proc/{pid1}/ns/pid")
    except OSError:
        return False
    for _ in range(rounds):
        victims = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != pid1:
                with contextlib.suppress(OSError):  # exited, or a zombie (its namespaces are gone)
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        victims.append(int(entry))
        if not victims:
            return True
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, 9)
        time.sleep(0.001)
    return False


def _layer_state(upper: str) -> frozenset:
    """Every entry of a container's writable layer with its inode and ctime (any write changes it)."""
    state = set()
    for root, dirs, files in os.walk(upper):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            state.add((os.path.join(root, name), st.st_ino, st.st_ctime_ns))
    if not os.path.isdir(upper):
        raise FileNotFoundError(upper)
    return frozenset(state)


def _label_changes(labels: dict[str, str]) -> list[str]:
    return [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


# -- garbage collection ---------------------------------------------------------------------------

def gc(all: bool = False, dry_run: bool = False) -> list[str]:
    """Remove what crashed crr runs left: labelled containers and snapshot images whose owner
    process is gone, and engine directories (with their mounts) on this host; with `all`, also the
    per-task image cache. Nothing without crr's label is touched, nor anything a live process owns.
    Returns what was removed (with `dry_run`: what would be)."""
    api = docker_client().api
    done: list[str] = []
    for c in api.containers(all=True, filters={"label": f"{OWNER}=crr"}):
        if _owner_alive(c["Labels"]):
            continue
        done.append(f"container {c['Names'][0].lstrip('/')}")
        if not dry_run:
            with contextlib.suppress(docker.errors.NotFound):
                api.remove_container(c["Id"], force=True)
    images = [im for im in api.images(all=True, filters={"label": f"{OWNER}=crr"})
              if ((im.get("Labels") or {}).get(ROLE) == "snapshot" and not _owner_alive(im["Labels"]))
              or ((im.get("Labels") or {}).get(ROLE) == "task" and all)]
    return done + _remove_images(api, images, dry_run) + _gc_host(all, dry_run)


def _remove_images(api: docker.APIClient, images: list[dict], dry_run: bool = False) -> list[str]:
    """Remove images newest first and by tag, so that a parent snapshot is only untagged and goes
    with its last child; one in use by a container is left (and logged). Returns what went."""
    done: list[str] = []
    for im in sorted(images, key=lambda i: -i["Created"]):
        tags = [t for t in im.get("RepoTags") or [] if t != "<none>:<none>"]
        for ref in tags or [im["Id"]]:
            try:
                if not dry_run:
                    api.remove_image(ref)
                done.append(f"image {ref if tags else ref[7:19]}")
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                log.info("left image %s: %s", ref, e.explanation)
    return done


def _gc_host(all: bool, dry_run: bool) -> list[str]:
    """Engine directories of dead owners (found in the cache and, for other cache roots, by their
    mounts), mounts first; with `all`, also the /testbed trees extracted from images."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    roots = {Path(p[:p.index("/crr-docker-")]) / p[p.index("/crr-docker-") + 1:].split("/")[0]
             for p in points if "/crr-docker-" in p}
    here = cache_root() / "docker"
    roots |= set(here.glob("crr-docker-*")) if here.is_dir() else set()
    done: list[str] = []
    for root in sorted(roots):
        try:
            labels = json.loads((root / "owner.json").read_text())
        except (OSError, ValueError):
            continue  # not an engine dir, or one being made right now
        if _owner_alive(labels):
            continue
        done += [f"mount {m}" for m in mounts_under(root)] + [f"dir {root}"]
        if not dry_run:
            _dispose_root(root)
    extracted = cache_root() / "docker-testbed"
    if all and extracted.is_dir():
        done.append(f"dir {extracted}")
        if not dry_run:
            shutil.rmtree(extracted, ignore_errors=True)
    return done
