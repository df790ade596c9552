"""gc of the local engine: what crr processes that no longer exist left (mounts, dirs, cgroups), and the
removal of one sandbox's."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from crr.sandbox.local.cgroups import _kill_cgroup, _memory_cgroup_root, _pids_cgroup_root, _remove_cgroup
from crr.sandbox.local.common import _PREFIX, OWNER_FILE, default_workdir
from crr.sandbox.overlay import Workspace, mounts_under, process_start, unmount

log = logging.getLogger(__name__)


def gc_leftovers(workdir: Path | None = None, dry_run: bool = False) -> list[str]:
    """Remove the mounts, dirs and (pids and memory) cgroups of local engines whose owning process is gone.

    Only crr's: an engine dir carries OWNER_FILE with its owner's pid and start time, so a live
    engine (or a reused pid) is never touched; an engine's cgroup is named after its dir and holds
    its owner's spawner thread for as long as the owner lives. Returns what was removed (with
    `dry_run`: what would be, nothing touched).
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
        removed.append(str(cgroup))
        if dry_run:
            continue
        # commands in flight when the owner died: before unmounting their cwd (a sandbox's memory
        # cgroup is a child of its engine's)
        for child in [*(c for c in cgroup.iterdir() if c.is_dir()), cgroup]:
            _kill_cgroup(child)
            _remove_cgroup(child)
    for d in sorted(root.glob(f"{_PREFIX}*")) if root.is_dir() else []:
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # not an engine dir, or one being created right now
        if process_start(owner.get("pid", -1)) == owner.get("start"):
            continue
        mounts = mounts_under(d)
        removed += [*mounts, str(d)]
        if dry_run:
            continue
        for mnt in mounts:
            unmount(mnt)
        shutil.rmtree(d, ignore_errors=True)
    if removed and not dry_run:
        log.info("removed %d leftovers of crashed local engines under %s", len(removed), root)
    return removed


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
