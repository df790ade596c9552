"""Task sources: where a task's git repository comes from, chosen by what its row carries.

The sandbox layer checks a task out (crr.sandbox.checkout.base_checkout) without knowing how its
repository is made: it asks the resolver this module registers with it (`checkout.set_repository`), and
each source here says which rows it serves and hands back a path to a git repository or bundle that holds
the row's base_commit. crr's own, registered when crr.tasks is imported, so every Task has them:

    repo_src  the row names a git repository or bundle (a micro set's bundles, a local clone)
    sdist     the row pins a PyPI source distribution; its repository is rebuilt from it (crr.tasks.synth)

A new one is

    register_source("hf_snapshot", lambda task: "hf_snapshot" in task.metadata, fetch_snapshot)

Sources are asked in the order they were registered; the first that serves the row materialises it, so a
row with both repo_src and sdist is checked out from repo_src.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crr.errors import CRRError
from crr.sandbox import checkout
from crr.sandbox.base import TaskSpec
from crr.tasks.schema import Task


@dataclass(frozen=True)
class TaskSource:
    name: str
    serves: Callable[[TaskSpec], bool]        # does this row carry what the source needs?
    materialise: Callable[[TaskSpec], Path]   # a git repository or bundle holding task.base_commit


SOURCES: dict[str, TaskSource] = {}


def register_source(name: str, serves: Callable[[TaskSpec], bool], materialise: Callable[[TaskSpec], Path]) -> None:
    """Add (or replace, keeping its place) the source `name`."""
    SOURCES[name] = TaskSource(name, serves, materialise)


def repository(task: TaskSpec) -> Path:
    """The repository (or bundle) of `task` from the first registered source that serves it."""
    for source in SOURCES.values():
        if source.serves(task):
            return source.materialise(task)
    raise CRRError(f"task {task.instance_id} has no repo_src, so it cannot be checked out locally; "
                   "give it a repo_src (a git repository or bundle) or run it with --engine docker "
                   f"and an image that holds the repository (task sources: {', '.join(SOURCES) or 'none registered'})")


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
checkout.set_repository(repository)
