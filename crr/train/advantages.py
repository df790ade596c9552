"""Advantage estimators (paper: Preliminaries, the GRPO advantage; Method, Eq. 2-3; Appendix "Search-Select
protocol"; and the step-credit methods the field compares CRR with), chosen by name, and the per-token (B, T)
layout the trainer hands to TRL's loss.

Every estimator maps a batch of rows (one realised trajectory each, G siblings per task) to one
advantage per step of each row, or None for a row that is excluded from training (an infrastructure
failure: its return is unknown, so it is left out of the group mean and of the loss, never scored 0).
Every estimator gets the same record per row (`RowCredit`), whatever the method is named; what a method
collects for it (selected steps, forks, state keys) is its row in `crr.train.config.METHODS`:

    grpo           A_t = R(tau) - mean of the scored siblings' R, no std scaling, shared by all steps
    crr            Eq. 3: selected steps A_t = R(tau) - mean_K R(tilde tau_t); other steps the group
                   advantage (a selected step whose forks all failed or were skipped keeps it too)
    zero_contrast  control: every selected step gets A_t = 0 (no counterfactual signal there), others grpo
    search_select  grpo over the rows after `search_select_choice` swapped in fork-derived sequences
    gigpo          GiGPO: the episode advantage + omega x a step advantage within groups of equal states
    mc_values      VinePPO-style: A_t = V(s_{t+1}) - V(s_t), V from on-policy continuations of a fork of s_t
    resets         SRPO/RRPO: GRPO within the rows that share a task and a reset state, on the steps each row
                   sampled itself (a restart row's prefix, a failed sibling's, gets 0)

A researcher adds one with `@estimator("name")` in any module, or names a function by dotted path in the
config (`advantage_estimator: mypkg.mod:fn` or `mypkg.mod.fn`, imported when the config is read); its keyword
parameters come from the config's `advantage_params` (`estimate(name, rows, **params)`; a parameter the
function does not take is a CRRError).

`token_advantages` writes A_t over a_t's action tokens (its span in completion_ids) and 0 elsewhere:
observation tokens carry no advantage (TRL masks them with env_mask -> tool_mask as well).
"""

from __future__ import annotations

import hashlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from crr.errors import CRRError
from crr.plugins import import_callable

Estimator = Callable[..., list[list[float] | None]]


@dataclass
class RowCredit:
    """What an estimator needs of one realised trajectory."""
    group_key: int                               # the task (prompt) whose G siblings this row is one of
    reward: float | None                         # R(tau); None: infrastructure failure
    spans: list[tuple[int, int]]                 # a_t's (start, end) in completion_ids
    selected: list[int] = field(default_factory=list)              # indices the selector chose
    counterfactuals: dict[int, list[float]] = field(default_factory=dict)  # t -> scored R(tilde tau_t), K of them
    # per step t: a key of s_t (tree digest before a_t + what the agent has observed); [] if unknown
    state_keys: list[str] = field(default_factory=list)
    # t -> scored R of on-policy continuations from s_t (a_t resampled from pi, then on policy)
    continuations: dict[int, list[float]] = field(default_factory=dict)
    # the first step this row sampled: 0, or (method resets) the state a failed sibling was reset to
    reset: int = 0


def state_keys(steps: Sequence) -> list[str]:
    """A key of each s_t: the sandbox tree digest recorded before a_t plus a hash of o_0..o_{t-1}, what the
    agent has observed (its prompt is the task's, the same for every sibling). Equal keys: the same
    repository and the same history of observations. [] when a step has no recorded digest."""
    if not steps or any(s.digest is None for s in steps):
        return []
    seen, keys = hashlib.sha256(), []
    for s in steps:
        keys.append(hashlib.sha256(f"{s.digest}:{seen.hexdigest()}".encode()).hexdigest()[:24])
        seen.update(s.observation.encode() + b"\0")
    return keys


ESTIMATORS: dict[str, Estimator] = {}


def estimator(name: str) -> Callable[[Estimator], Estimator]:
    """Register `fn(rows, **params)` under `name` (`@estimator("name")`)."""
    def register(fn: Estimator) -> Estimator:
        ESTIMATORS[name] = fn
        return fn
    return register


def resolve(name: str) -> Estimator:
    """A registered estimator, or a function named by dotted path (`pkg.mod:fn` or `pkg.mod.fn`)."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    fn = import_callable(name, "advantage estimator")
    if fn is None:
        raise CRRError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)} "
                       "or name a function as module.path:function")
    return fn


def check(name: str, params: dict) -> Estimator:
    """The estimator `name`, having checked that it takes `params` as keywords (else a CRRError)."""
    fn = resolve(name)
    try:
        inspect.signature(fn).bind(None, **params)
    except TypeError as e:
        raise CRRError(f"advantage estimator {name!r} does not take advantage_params {params}: {e}") from None
    return fn


def estimate(name: str, rows: Sequence[RowCredit], **params) -> list[list[float] | None]:
    return check(name, params)(rows, **params)


def group_baselines(rows: Sequence[RowCredit]) -> dict[int, float]:
    """mean R over the scored rows of each group (the G siblings; infra failures left out)."""
    scored: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.reward is not None:
            scored[r.group_key].append(r.reward)
    return {g: sum(v) / len(v) for g, v in scored.items()}


@estimator("grpo")
def grpo(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    base = group_baselines(rows)
    return [None if r.reward is None else [r.reward - base[r.group_key]] * len(r.spans) for r in rows]


estimator("search_select")(grpo)


@estimator("crr")
def crr(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    out = grpo(rows)
    for r, adv in zip(rows, out):
        if adv is None:
            continue
        for t in r.selected:
            if r.counterfactuals.get(t):
                adv[t] = r.reward - sum(r.counterfactuals[t]) / len(r.counterfactuals[t])
    return out


@estimator("zero_contrast")
def zero_contrast(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    out = grpo(rows)
    for r, adv in zip(rows, out):
        for t in r.selected if adv is not None else ():
            adv[t] = 0.0
    return out


def state_groups(rows: Sequence[RowCredit]) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """GiGPO's step groups (Eq. 6): (row, t) of the scored siblings' steps, keyed by (task, key of s_t)."""
    groups: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r.reward is not None:
            for t, key in enumerate(r.state_keys):
                groups[(r.group_key, key)].append((i, t))
    return groups


@estimator("gigpo")
def gigpo(rows: Sequence[RowCredit], omega: float = 1.0) -> list[list[float] | None]:
    """GiGPO (Feng et al., arXiv 2505.10978, Eq. 8; verl-agent gigpo/core_gigpo.py, mode "mean_norm"):
    A_t = A^E(tau) + omega A^S(s_t, a_t). A^E = R(tau) - mean of the siblings' R (Eq. 3, crr's GRPO).
    A^S = R_t - mean of R_t' over the step group of s_t (Eq. 7): the steps of the G siblings whose state
    key equals s_t's (Eq. 6, exact match). R_t is the discounted return from step t (Eq. 5); the only
    reward is R(tau) at the end and crr does not discount, so R_t = R(tau). Mean-only, as the reference's
    default and crr's GRPO (scale_rewards none): a std over 2-3 binary returns would blow small
    differences up to +-1. A step alone in its group has A^S = 0; a row without state keys gets A^E."""
    out = grpo(rows)
    for members in state_groups(rows).values():
        base = sum(rows[i].reward for i, _ in members) / len(members)
        for i, t in members:
            out[i][t] += omega * (rows[i].reward - base)
    return out


@estimator("mc_values")
def mc_values(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    """Monte-Carlo values, VinePPO-style (Kazemnejad et al., arXiv 2410.01679, Eq. 6 with gamma = 1 and
    only a terminal reward): V(s_t) = mean R of the K on-policy continuations from a fork of s_t,
    A_t = V(s_{t+1}) - V(s_t), V(s_T) = R(tau). A state with no scored continuation (submit is never
    forked; a fork that failed) takes the next state's value, so its step gets A_t = 0."""
    out: list[list[float] | None] = []
    for r in rows:
        if r.reward is None:
            out.append(None)
            continue
        v = [0.0] * len(r.spans) + [r.reward]
        for t in reversed(range(len(r.spans))):
            cont = r.continuations.get(t)
            v[t] = sum(cont) / len(cont) if cont else v[t + 1]
        out.append([v[t + 1] - v[t] for t in range(len(r.spans))])
    return out


@estimator("resets")
def resets(rows: Sequence[RowCredit]) -> list[list[float] | None]:
    """Resets (Samanta et al., arXiv 2605.25507, RRPO and SRPO): M suffixes are resampled on policy from a
    state s_t of a failed trajectory, and the policy gradient is applied to the suffix tokens only, with the
    group-relative advantage A = R - mean R over the suffixes of that state (a GRPO group of shared-prefix
    rollouts). A row here is one of a task's on-policy trajectories (reset = 0) or a restart row (reset =
    t > 0): its group is the rows of its task with the same reset (crr resets one state per task and update,
    and a task with no failure to reset from gets fresh rows from s_0, which join its on-policy group). The
    steps before a row's reset are a sibling's, not sampled by it: A = 0 there (the trainer also masks them)."""
    scored: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rows:
        if r.reward is not None:
            scored[(r.group_key, r.reset)].append(r.reward)
    out: list[list[float] | None] = []
    for r in rows:
        if r.reward is None:
            out.append(None)
            continue
        suffixes = scored[(r.group_key, r.reset)]
        a = r.reward - sum(suffixes) / len(suffixes)
        out.append([0.0 if t < r.reset else a for t in range(len(r.spans))])
    return out


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
