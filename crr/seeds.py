"""Seeds derived from a run's seed: one function, so that every stream a run draws is named by its keys.

    derive_seed(seed, round_index)          # a rollout round's generation seed (crr.rollout.sample_seed)
    derive_seed(seed, pass_index, chunk)    # an evaluation chunk's rollout seed
"""

from __future__ import annotations

import numpy as np


def derive_seed(seed: int, *keys: int) -> int:
    """A 32-bit seed for the stream (seed, *keys): numpy's SeedSequence hash of the whole key, so that
    different keys give independent streams and the same key the same stream on every machine."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])
