"""crr.seeds: the two ways a stream is named by its keys."""

from __future__ import annotations

import random
from pathlib import PurePosixPath

from crr.seeds import derive_seed, keyed_random


def draws(rng: random.Random) -> tuple:
    return rng.getrandbits(64), rng.random(), rng.sample(range(100), 5)


def test_keyed_random_is_the_string_seeded_generator_every_task_set_was_made_with():
    # The keys of each former random.Random(f"...") call site, against the f-string it replaced (task
    # generation, the expert, the curriculum, the filter's run seeds).
    seed, split, index, attempt, name = 3, "train", 17, 2, "nano-train-3-17"
    cases = [
        (("micro", seed, split, 64, "flaky"), f"micro:{seed}:{split}:64:flaky"),
        (("nano", seed, split, "order"), f"nano:{seed}:{split}:order"),
        (("multi", seed, split, index, attempt), f"multi:{seed}:{split}:{index}:{attempt}"),
        (("crr-synth", seed, "six", "1.17.0"), f"crr-synth:{seed}:six:1.17.0"),
        (("expert", seed, name), f"expert:{seed}:{name}"),
        (("curriculum", seed), f"curriculum:{seed}"),
        (("crr-filter", seed, PurePosixPath("a/b")), f"crr-filter:{seed}:{PurePosixPath('a/b')}"),
    ]
    for keys, old in cases:
        assert draws(keyed_random(*keys)) == draws(random.Random(old)), keys
    # Pinned: a change of Python's string seeding would change every generated task set.
    assert keyed_random("expert", 0, "nano-train-0-0").getrandbits(32) == 562648580
    assert draws(keyed_random("curriculum", 1)) != draws(keyed_random("curriculum", 2))
    assert derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(0, 2) != derive_seed(1, 1)
