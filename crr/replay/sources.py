"""Task sources: where a task's git repository comes from, chosen by what its row carries.

The replay layer checks a task out (crr.replay.checkout.base_checkout) without knowing how its repository
is made: each source says which rows it serves and hands back a path to a git repository or bundle that
holds the row's base_commit. The tasks layer registers crr's own (crr.tasks.sources: `repo_src`, a path
in the row, and `sdist`, a repository rebuilt from a PyPI source distribution); a new one is

    register_source("hf_snapshot", lambda task: "hf_snapshot" in task.metadata, fetch_snapshot)

Sources are asked in the order they were registered; the first that serves the row materialises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from crr.errors import CRRError
from crr.replay.base import TaskSpec


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
