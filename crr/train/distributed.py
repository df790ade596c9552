"""`crr train` across processes (data parallel, as TRL trains on several GPUs):

    accelerate launch --num_processes N -m crr train --config ...

Each process holds a replica of the policy, its own fork engine and sandboxes, and rolls out its share
of every generation batch: TRL's RepeatSampler draws `tasks_per_iteration` tasks x G, and each process
gets a contiguous `tasks_per_iteration / N` of those tasks with all G of their siblings (crr.train.config
makes the per-process batch a whole number of groups), so rollouts, selections and forks stay inside one
process. What is written (ledger, tuples, metrics, config, checkpoints) is gathered to every process,
so that all of them take the same decisions (budget stops, checkpoints), and written by the main one only.

One process (plain `crr train`, or N = 1) is the special case: every gather below returns its input.
The distributed state is accelerate's PartialState, which building a CRRConfig initialises (TRL's config
reads the world size), so these helpers are called after the config exists.
"""

from __future__ import annotations

import os
from typing import Any

from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

_WORLD_SIZE_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_processes() -> int:
    """How many processes the launcher started (accelerate launch / torchrun / mpirun set it); 1 when run
    plainly. Read from the environment because the config needs it before the distributed state exists."""
    for name in _WORLD_SIZE_ENV:
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def num_processes() -> int:
    return PartialState().num_processes


def is_main() -> bool:
    return PartialState().is_main_process


def gather(items: list) -> list:
    """Every process's `items`, concatenated in process order, on every process."""
    return gather_object(list(items)) if num_processes() > 1 else list(items)


def gather_one(obj: Any) -> list:
    """One object per process, in process order, on every process."""
    return gather([obj])


def broadcast(obj: Any) -> Any:
    """The main process's `obj`, on every process."""
    if num_processes() == 1:
        return obj
    return broadcast_object_list([obj])[0]


def barrier() -> None:
    if num_processes() > 1:
        PartialState().wait_for_everyone()
