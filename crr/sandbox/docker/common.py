"""What every part of the Docker engine shares: the labels that mark crr's containers and images, the
client, PID 1's and an action's scripts (the command channel), and the engine's host directory."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import socket
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import requests
from docker.types import LogConfig

from crr.errors import SandboxError
from crr.sandbox.overlay import mounts_under, process_start, unmount

log = logging.getLogger(__name__)

REPO_DIR = "/testbed"
CTL_DIR = "/run/crr"  # in every container: the host side of the command channel
DEFAULT_BASE_IMAGE = "crr-base:bookworm"
SNAPSHOT_REPO, TASK_REPO, ENV_REPO = "crr-snap", "crr-task", "crr-env"
OWNER, ROLE, ENGINE, PID, PIDSTART, HOST, TASK = (
    f"org.crr.{k}" for k in ("owner", "role", "engine", "pid", "pidstart", "host", "task"))
# What every action sees on top of the image's environment (the same as the local engine's).
DEFAULT_ENV = {"TZ": "UTC", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
SCRATCH_DIRS = ("/tmp", "/root", "/var/tmp")  # overlay mode: the writable dirs of a read-only root (HOME is /root)
CTL_TMPFS_MB = 16  # the command channel's tmpfs (action scripts and exit statuses), as root
# PID 1's stdout and stderr reach Docker's log on the host disk, and a command can write to them.
_LOG = LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"})
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



def docker_client(fix: str = "start it (dockerd) or use --engine local") -> docker.DockerClient:
    """A client for the local daemon, or a SandboxError that says how to get one (`fix`)."""
    try:
        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except (docker.errors.DockerException, requests.RequestException, OSError) as e:
        raise SandboxError(f"the Docker daemon is not reachable ({e}); {fix}") from None


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



def _label_changes(labels: dict[str, str]) -> list[str]:
    return [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info

