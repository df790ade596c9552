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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from crr.errors import CRRError
from crr.sandbox.base import TaskSpec


# Where a task's repository comes from is the tasks layer's business: crr.tasks.sources registers its
# resolver here when crr.tasks is imported (a lower layer never imports a higher one).
_repository: Callable[[TaskSpec], Path] | None = None


def set_repository(resolve: Callable[[TaskSpec], Path]) -> None:
    """Make `base_checkout` ask `resolve(task)` for the git repository (or bundle) of a task."""
    global _repository
    _repository = resolve


def cache_root() -> Path:
    root = Path(os.environ.get("CRR_CACHE_DIR", Path.home() / ".cache" / "crr"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _git(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise CRRError(f"git {' '.join(args)} failed: {out.stderr.strip()[-400:]}")
    return out.stdout


def publish(built: Path, dest: Path, keep_theirs: Callable[[Path], bool] = Path.is_dir) -> None:
    """Move a freshly built folder into place as `dest` in one rename (an empty `dest` is replaced), so that
    readers see no folder or a whole one. If another process filled `dest` meanwhile, theirs is kept when
    `keep_theirs(dest)` says it is whole (the default: it is a folder); otherwise a CRRError says so."""
    try:
        os.rename(built, dest)
    except OSError:
        if keep_theirs(dest):
            return
        if dest.exists():
            raise CRRError(f"{dest} was written by someone else while this build ran; choose a new path") from None
        raise


@contextmanager
def building(dest: Path, keep_theirs: Callable[[Path], bool] = Path.is_dir) -> Iterator[Path]:
    """Build the folder `dest` whole or not at all: yields a path beside it (not yet made) to build into,
    published as `dest` (`publish`) when the block ends without error; the temporary sibling is removed
    in any case, so a crash leaves nothing half-built behind."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        yield work / dest.name
        publish(work / dest.name, dest, keep_theirs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cached_repo(kind: str, task: TaskSpec, key: str, build: Callable[[Path], None]) -> Path:
    """The cache entry `<cache>/<kind>/<instance>-<key>`: on first use `build(repo)` makes the repository
    in a temporary sibling, which is then published whole (a crash leaves nothing half-built behind)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task.instance_id)[:80]
    dest = cache_root() / kind / f"{safe}-{key}"
    if dest.is_dir():
        return dest
    with building(dest) as repo:
        build(repo)
    return dest


def base_checkout(task: TaskSpec) -> Path:
    """Path of a clean checkout of the task's repository at `task.base_commit` (with its .git); the
    repository comes from the task source that serves the row (crr.tasks.sources: `repo_src`, or the
    `sdist` a synthesised task is rebuilt from), registered with `set_repository`."""
    if _repository is None:
        raise CRRError("no task sources are registered to check a task out from; import crr.tasks first")
    src = _repository(task)

    def clone(repo: Path) -> None:
        _git("clone", "-q", "--no-checkout", str(src), str(repo))
        _git("-c", "advice.detachedHead=false", "checkout", "-q", task.base_commit, cwd=repo)

    key = hashlib.sha256(f"{src.resolve()}\0{task.base_commit}".encode()).hexdigest()[:16]
    return cached_repo("checkouts", task, key, clone)
