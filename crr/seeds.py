"""Seeds derived from a run's seed, so that every stream a run draws is named by its keys.

    derive_seed(seed, round_index)          # a rollout round's generation seed (crr.rollout.sample_seed)
    derive_seed(seed, pass_index, chunk)    # an evaluation chunk's rollout seed
    keyed_random("micro", seed, split, index, attempt)   # a generated task's choices (crr.tasks.micro)
    check_seed(seed)                        # a run's seed, before anything is drawn with it

Two offsets stay as they are: a training iteration's seed s = derive_seed(seed, step) drives its rollout
rounds (derive_seed(s, round)) and its selector (numpy's default_rng(s)), while its forks draw from s + 1
(branch rounds derive_seed(s + 1, round)) and its injected replay noise from s + 2 (default_rng([s + 2,
branch, t])), in crr.train.trainer's `_branch`. Each is hashed again with other keys by SeedSequence, so the
streams are independent of s's. They are not converted to derive_seed(s, 1) and derive_seed(s, 2) because
every CRR run's counterfactual draws were made with them: the CRR runs of results/reference/cpu-main and the
README's `make main` log would no longer be what a run with their seed gives. For the same reason the expert's
episode k of a `crr sft` run plays with seed `seed * 1000 + k` (crr.sft.warm_start; a recorded field of
expert.jsonl, then keyed_random("expert", that seed, instance_id)): every shipped recipe's expert data was drawn so.

`keyed_random` is the older second form, kept because its streams define every generated task set, expert
plan and curriculum row that committed results were measured on: Python's `random.Random` seeded by the
keys joined with ':' (a string seed, hashed by SHA-512), for the code that draws with `random`'s API.
"""

from __future__ import annotations

import random

from crr.errors import CRRError

MAX_SEED = 2**32 - 1   # the largest seed every consumer takes: numpy's legacy seeding (transformers' set_seed)


def check_seed(seed: int, name: str = "seed") -> None:
    """A CRRError unless `seed` is one every stream can be seeded with (0..MAX_SEED)."""
    if not 0 <= seed <= MAX_SEED:
        raise CRRError(f"{name} must be between 0 and {MAX_SEED}, got {seed}")


def derive_seed(seed: int, *keys: int) -> int:
    """A 32-bit seed for the stream (seed, *keys): numpy's SeedSequence hash of the whole key, so that
    different keys give independent streams and the same key the same stream on every machine."""
    import numpy as np   # deferred: the CLI reads MAX_SEED as it starts, before any command needs numpy

    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def keyed_random(*keys: object) -> random.Random:
    """A `random.Random` for the stream named by `keys`: seeded by the string ':'.join(map(str, keys)), so
    keyed_random("expert", seed, instance_id) is random.Random(f"expert:{seed}:{instance_id}")."""
    return random.Random(":".join(map(str, keys)))
