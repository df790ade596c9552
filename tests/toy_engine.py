"""A fork engine outside crr (ARCHITECTURE.md: "A new fork engine"): the local engine under another name.

Named by its dotted path, it needs no registration: `crr tool --engine toy_engine:ToyEngine --engine-opt
fsize_limit_mb=4` (with this folder on PYTHONPATH), or `engine: toy_engine:ToyEngine` in a config. Its
constructor's keywords are its options, which crr.sandbox.engines checks before anything starts.
tests/test_engine_contract.py runs the engine contract against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from crr.sandbox.base import Sandbox, Snapshot, TaskSpec
from crr.sandbox.local import LocalEngine


class ToyEngine:
    name = "toy"

    def __init__(self, fsize_limit_mb: int = 1024, workdir: Path | None = None):
        self.inner = LocalEngine(workdir=workdir, fsize_limit_mb=fsize_limit_mb)

    def start(self, task: TaskSpec) -> Sandbox:
        return self.inner.start(task)

    def restore(self, snapshot: Snapshot) -> Sandbox:
        return self.inner.restore(snapshot)

    def release(self, snapshot: Snapshot) -> None:
        self.inner.release(snapshot)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
