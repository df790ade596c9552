"""Base checkouts: a task's repository at `base_commit`, materialised once per machine and cached.

Every sandbox of a task starts from this read-only tree (as an overlay lower layer, a bind mount,
or the context of a per-task image), so starting a sandbox never clones again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from crr.errors import CRRError
from crr.replay.base import TaskSpec
from crr.replay.sources import repository


def cache_root() -> Path:
    root = Path(os.environ.get("CRR_CACHE_DIR", Path.home() / ".cache" / "crr"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _git(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise CRRError(f"git {' '.join(args)} failed: {out.stderr.strip()[-400:]}")
    return out.stdout


def publish(built: Path, dest: Path) -> None:
    """Move a freshly built cache entry into place; if another process got there first, keep theirs."""
    try:
        os.rename(built, dest)
    except OSError:
        if not dest.is_dir():
            raise


def cached_repo(kind: str, task: TaskSpec, key: str, build: Callable[[Path], None]) -> Path:
    """The cache entry `<cache>/<kind>/<instance>-<key>`: on first use `build(repo)` makes the repository
    in a temporary sibling, which is then published whole (a crash leaves nothing half-built behind)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task.instance_id)[:80]
    dest = cache_root() / kind / f"{safe}-{key}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{safe}."))
    try:
        build(tmp / "repo")
        publish(tmp / "repo", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def base_checkout(task: TaskSpec) -> Path:
    """Path of a clean checkout of the task's repository at `task.base_commit` (with its .git); the
    repository comes from the task source that serves the row (crr.replay.sources: `repo_src`, or the
    `sdist` a synthesised task is rebuilt from)."""
    src = repository(task)

    def clone(repo: Path) -> None:
        _git("clone", "-q", "--no-checkout", str(src), str(repo))
        _git("-c", "advice.detachedHead=false", "checkout", "-q", task.base_commit, cwd=repo)

    key = hashlib.sha256(f"{src.resolve()}\0{task.base_commit}".encode()).hexdigest()[:16]
    return cached_repo("checkouts", task, key, clone)
