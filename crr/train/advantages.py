"""Advantage estimators (paper: Preliminaries, the GRPO advantage; Method, Eq. 2-3; Appendix "Search-Select
protocol"), chosen by name, and the per-token (B, T) layout the trainer hands to TRL's loss.

Every estimator maps a batch of rows (one realised trajectory each, G siblings per task) to one
advantage per step of each row, or None for a row that is excluded from training (an infrastructure
failure: its return is unknown, so it is left out of the group mean and of the loss, never scored 0):

    grpo           A_t = R(tau) - mean of the scored siblings' R, no std scaling, shared by all steps
    crr            Eq. 3: selected steps A_t = R(tau) - mean_K R(tilde tau_t); other steps the group
                   advantage (a selected step whose forks all failed or were skipped keeps it too)
    zero_contrast  control: the same selected steps get A_t = 0 (no counterfactual signal there)
    search_select  grpo over the rows after `search_select_choice` swapped in fork-derived sequences

`token_advantages` writes A_t over a_t's action tokens (its span in completion_ids) and 0 elsewhere:
observation tokens carry no advantage (TRL masks them with env_mask -> tool_mask as well).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from crr.errors import CRRError


@dataclass
class RowCredit:
    """What an estimator needs of one realised trajectory."""
    group: int                                   # the task (prompt) this row is a sibling in
    reward: float | None                         # R(tau); None: infrastructure failure
    spans: list[tuple[int, int]]                 # a_t's (start, end) in completion_ids
    selected: list[int] = field(default_factory=list)              # indices the selector chose
    counterfactuals: dict[int, list[float]] = field(default_factory=dict)  # t -> scored R(tilde tau_t), K of them
    state_keys: list[str] = field(default_factory=list)                 # per step t: a key of s_t (tree digest before a_t + what the agent has observed); [] if unknown
    continuations: dict[int, list[float]] = field(default_factory=dict)  # t -> scored R of on-policy continuations from s_t (a_t resampled from pi, then on policy)


def group_baselines(rows: Sequence[RowCredit]) -> dict[int, float]:
    """mean R over the scored rows of each group (the G siblings; infra failures left out)."""
    scored: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.reward is not None:
            scored[r.group].append(r.reward)
    return {g: sum(v) / len(v) for g, v in scored.items()}


def grpo(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    base = group_baselines(rows)
    return [None if r.reward is None else [r.reward - base[r.group]] * len(r.spans) for r in rows]


def _hybrid(rows: Sequence[RowCredit], contrast: Callable[[float, list[float]], float]) -> list[list[float] | None]:
    out = grpo(rows)
    for r, adv in zip(rows, out):
        if adv is None:
            continue
        for t in r.selected:
            if r.counterfactuals.get(t):
                adv[t] = contrast(r.reward, r.counterfactuals[t])
    return out


def crr(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    return _hybrid(rows, lambda reward, cf: reward - sum(cf) / len(cf))


def zero_contrast(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    return _hybrid(rows, lambda reward, cf: 0.0)


ESTIMATORS: dict[str, Callable[[Sequence[RowCredit]], list[list[float] | None]]] = {
    "grpo": grpo, "crr": crr, "zero_contrast": zero_contrast, "search_select": grpo}


def estimate(name: str, rows: Sequence[RowCredit]) -> list[list[float] | None]:
    if name not in ESTIMATORS:
        raise CRRError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](rows)


def search_select_choice(reward: float | None, fork_returns: Sequence[float | None]) -> int | None:
    """The fork whose sequence replaces the realised one: the verifier-best, only if its return is
    strictly higher than R(tau) (ties keep the realised sequence; the first best fork wins a tie among
    forks). None: keep the realised sequence (also for an unscored realised trajectory)."""
    if reward is None:
        return None
    best = max(((r, -i) for i, r in enumerate(fork_returns) if r is not None), default=None)
    return -best[1] if best is not None and best[0] > reward else None


def token_advantages(rows: Sequence[RowCredit], step_advantages: Sequence[list[float] | None],
                     length: int) -> torch.Tensor:
    """(B, length) advantages: A_t over a_t's action tokens, 0 on observation tokens, padding and
    excluded rows. Spans past `length` (a completion TRL truncated) are clipped."""
    out = torch.zeros(len(rows), length)
    for i, (r, adv) in enumerate(zip(rows, step_advantages)):
        if adv is None:
            continue
        if len(adv) != len(r.spans):
            raise CRRError(f"row {i}: {len(adv)} step advantages for {len(r.spans)} steps")
        for (start, end), a in zip(r.spans, adv):
            out[i, start:min(end, length)] = a
    return out
