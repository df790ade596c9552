"""The local engine's cgroups (v1): a pids cgroup per engine, a memory cgroup per sandbox, and their removal."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from pathlib import Path

from crr.sandbox.local.common import CGROUP_REMOVE_S, _warn_once

log = logging.getLogger(__name__)


def _join_thread(cgroup: Path) -> None:
    """Move the calling thread (only it: cgroup v1 `tasks` takes a thread id) into `cgroup`."""
    (cgroup / "tasks").write_text(str(threading.get_native_id()))


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
