"""Decision-point selectors (paper: Method, "Decision-Point Selector", Eq. 4; Algorithm 1, line 4).

Every selector picks at most k indices from the same eligible set: steps that are not terminal (submit
is never forked), whose call was valid (an invalid call or one cut off by the token budget has no type
score and its "state" is an error observation, so the paper's type-weighted score is undefined there),
and whose entropy H_t exceeds eta (a near-deterministic policy has no plausible alternative; the paper
skips the index rather than force an out-of-support action). They differ only in which of the eligible
steps they keep:

    entropy_type  top-k of H_t (1 + lambda_type * type(a_t))   (default, Eq. 4)
    entropy       top-k of H_t
    type          top-k of type(a_t), ties broken by H_t
    random        k uniformly without replacement (seeded)
    stride        k evenly spaced time quantiles of the eligible steps
    mid_value     forks where a branch can change the outcome: the states whose estimated success
                  probability p(s_t) is mid-range (0 < p < 1, closest to 1/2 first, then Eq. 4), p the
                  fraction of successes among the siblings whose trajectories pass through s_t (equal
                  state keys, `sibling_values`); a state only this trajectory reached is never mid-range
    first_edit_of_failure  the first consequential action of a failed trajectory (none of a success): the
                  first step that changed the repository (its tree digest differs from the next state's)
                  or, without recorded digests, the first edit_file call

Selectors are plain functions over anything with `entropy`, `tool_type` and `terminal` (crr's Step; and
`digest` for first_edit_of_failure), so they are testable without a model or a sandbox. Each returns the
chosen indices in time order with the Eq. 4 score of each (recorded in the tuples whatever the selector).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from crr.agent.tools import TOOL_TYPE_SCORES
from crr.errors import CRRError


class SelectableStep(Protocol):
    entropy: float              # H_t
    tool_type: float | None     # type(a_t); None for submit and invalid calls
    terminal: bool


@dataclass(frozen=True)
class SelectorParams:
    k: int = 4                  # fork budget per trajectory
    eta: float = 0.4            # entropy threshold
    lambda_type: float = 0.6    # type weight in Eq. 4

    def __post_init__(self) -> None:
        if self.k < 0:
            raise CRRError(f"the fork budget k must be >= 0, got {self.k}")
        if self.eta < 0:
            raise CRRError(f"the entropy threshold eta must be >= 0, got {self.eta}")


@dataclass(frozen=True)
class Context:
    """What a selector may know beyond the steps: R(tau), and p(s_t) per step (None: no estimate)."""
    reward: float | None = None
    values: Sequence[float | None] | None = None


@dataclass(frozen=True)
class Selection:
    t: int
    score: float                # Eq. 4's score of step t


def score(step: SelectableStep, lambda_type: float) -> float:
    """Eq. 4: H_t (1 + lambda_type * type(a_t))."""
    return step.entropy * (1.0 + lambda_type * (step.tool_type or 0.0))


def eligible(steps: Sequence[SelectableStep], eta: float) -> list[int]:
    """The shared eligible set: valid, non-terminal steps with H_t > eta."""
    return [t for t, s in enumerate(steps) if not s.terminal and s.tool_type is not None and s.entropy > eta]


def _top(steps: Sequence[SelectableStep], pool: list[int], k: int, key: Callable[[int], tuple]) -> list[int]:
    return sorted(sorted(pool, key=key)[:k])   # `key` sorts best first; ties fall to the earlier step


def entropy_type(steps, pool, p, rng, ctx):
    return _top(steps, pool, p.k, lambda t: (-score(steps[t], p.lambda_type), t))


def entropy(steps, pool, p, rng, ctx):
    return _top(steps, pool, p.k, lambda t: (-steps[t].entropy, t))


def type_(steps, pool, p, rng, ctx):
    return _top(steps, pool, p.k, lambda t: (-steps[t].tool_type, -steps[t].entropy, t))


def random(steps, pool, p, rng, ctx):
    if len(pool) <= p.k:
        return pool
    return sorted(int(t) for t in rng.choice(pool, size=p.k, replace=False))


def stride(steps, pool, p, rng, ctx):
    if len(pool) <= p.k:
        return pool
    if p.k == 0:
        return []
    return [pool[int(round(q))] for q in np.linspace(0, len(pool) - 1, p.k)]


def mid_value(steps, pool, p, rng, ctx):
    if ctx.values is None:
        raise CRRError("the mid_value selector needs p(s_t) from the siblings' state keys (sibling_values)")
    mid = [t for t in pool if t < len(ctx.values) and ctx.values[t] is not None and 0.0 < ctx.values[t] < 1.0]
    return _top(steps, mid, p.k, lambda t: (abs(ctx.values[t] - 0.5), -score(steps[t], p.lambda_type), t))


def first_edit_of_failure(steps, pool, p, rng, ctx):
    if ctx.reward != 0.0 or p.k == 0:
        return []
    return next(([t] for t in pool if _changes_repository(steps, t)), [])


def _changes_repository(steps, t: int) -> bool:
    before = getattr(steps[t], "digest", None)
    after = getattr(steps[t + 1], "digest", None) if t + 1 < len(steps) else None
    if before is not None and after is not None:
        return before != after
    return steps[t].tool_type == TOOL_TYPE_SCORES["edit_file"]


def sibling_values(keys: Sequence[Sequence[str]], rewards: Sequence[float | None],
                   groups: Sequence[int]) -> list[list[float | None]]:
    """p(s_t) for every step of every row: the fraction of successes among the scored rows of the same
    group (task) that pass through a state with s_t's key (the row itself included). None for the steps
    of a row without a return; [] for a row without keys."""
    through: dict[tuple[int, str], set[int]] = defaultdict(set)
    for i, (ks, r, g) in enumerate(zip(keys, rewards, groups)):
        if r is not None:
            for key in ks:
                through[(g, key)].add(i)
    return [[None if r is None else float(np.mean([rewards[j] for j in through[(g, key)]])) for key in ks]
            for ks, r, g in zip(keys, rewards, groups)]


SELECTORS: dict[str, Callable] = {"entropy_type": entropy_type, "entropy": entropy, "type": type_,
                                  "random": random, "stride": stride, "mid_value": mid_value,
                                  "first_edit_of_failure": first_edit_of_failure}
STATE_SELECTORS = frozenset({"mid_value", "first_edit_of_failure"})   # read the recorded tree digests
# top-k of a per-step key: a step in the final choice is in the choice of every prefix that holds it, so its
# fork can start as soon as it is realised (crr.train.counterfactual.LiveForks)
PREFIX_SELECTORS = frozenset({"entropy_type", "entropy", "type"})


def select(name: str, steps: Sequence[SelectableStep], params: SelectorParams,
           rng: np.random.Generator | None = None, context: Context = Context()) -> list[Selection]:
    """Up to k indices of `steps` chosen by the selector `name`, in time order. `rng` drives `random`;
    `context` holds R(tau) (first_edit_of_failure) and p(s_t) (mid_value)."""
    if name not in SELECTORS:
        raise CRRError(f"unknown selector {name!r}; choose one of {', '.join(SELECTORS)}")
    if name == "random" and rng is None:
        raise CRRError("the random selector needs a seeded numpy Generator (rng=)")
    chosen = SELECTORS[name](steps, eligible(steps, params.eta), params, rng, context)
    return [Selection(t, score(steps[t], params.lambda_type)) for t in chosen]


def select_each(name: str, trajs: Sequence, params: SelectorParams, rng: np.random.Generator | None = None,
                values: Sequence[Sequence[float | None]] | None = None) -> dict[int, list[Selection]]:
    """The picks of every scored trajectory (one with a `reward`), by row, from one `rng` in row order, each
    with its Context: R(tau) and, given `values` (sibling_values by row), p(s_t)."""
    return {i: select(name, t.steps, params, rng, Context(t.reward, None if values is None else values[i]))
            for i, t in enumerate(trajs) if t.reward is not None}
