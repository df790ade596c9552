"""What a model's forward passes are fed: (rows, tokens a row) of each call, recorded while the block runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def passes_fed(model: torch.nn.Module) -> Iterator[list[tuple[int, int]]]:
    fed: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: fed.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        yield fed
    finally:
        hook.remove()
