"""crr's task sources (crr.replay.sources), registered when crr.tasks is imported, so every Task has them:

    repo_src  the row names a git repository or bundle (a micro set's bundles, a local clone)
    sdist     the row pins a PyPI source distribution; its repository is rebuilt from it (crr.tasks.synth)

A row with both is checked out from repo_src.
"""

from __future__ import annotations

from pathlib import Path

from crr.errors import CRRError
from crr.replay.sources import register_source
from crr.tasks.schema import Task


def from_repo_src(task: Task) -> Path:
    src = Path(task.repo_src)
    if not src.exists():
        raise CRRError(f"task {task.instance_id}: repo_src {src} does not exist")
    return src


def from_sdist(task: Task) -> Path:
    # Deferred: synth pulls in yaml, unidiff, packaging and the micro templates (~0.15 s), which loading
    # a task row need not pay; nothing that synth imports imports this module.
    from crr.tasks.synth import materialise

    return materialise(task)


register_source("repo_src", lambda task: bool(task.repo_src), from_repo_src)
register_source("sdist", lambda task: bool(task.sdist), from_sdist)
