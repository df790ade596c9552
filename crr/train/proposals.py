"""Counterfactual proposals q_{not a_t}(. | s_t) (paper: Method, "Counterfactual Proposal"; Appendix
"Proposal composition" and the validity-filtered control).

    tempered           pi^(1/T_cf) restricted to actions != a_t: the backend's rejection-conditioned
                       sampler (`generate(..., exclude=[a_t], exclude_ids=[a_t's tokens])`); an index where
                       every try returned a_t is skipped (the policy is near-deterministic there), never forced.
    validity_filtered  the same, then a proposal that fails the syntax/schema check (a call cut off by
                       the token budget, a wrong argument) is resampled up to 3 times; still invalid:
                       skipped. This removes the "immediately invalid alternative" class of forks.
    on_policy          not a counterfactual: a_t resampled from pi at the given (the rollout) temperature, with
                       no exclusion, so it may repeat a_t. The first action of an on-policy continuation of
                       s_t (VinePPO's Monte-Carlo value, crr.train.counterfactual.continuations).

A proposal returns, per selected step, the StepSample to play instead of a_t or None (skip the fork).
A counterfactual one never returns the realised action: the canonical forms are compared here as well as
in the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from crr.agent.tools import ToolCallError, parse_tool_call
from crr.errors import CRRError
from crr.seeds import derive_seed

if TYPE_CHECKING:   # annotations only: the registry's names are read without torch (crr.credit.audit)
    from crr.policy.backend import GenerationBackend, StepSample

VALIDITY_RESAMPLES = 3


def _canonical(text: str) -> str | None:
    try:
        return parse_tool_call(text).canonical()
    except ToolCallError:
        return None


def tempered(backend: GenerationBackend, conversations: list[list[dict]], realised: list[str],
             realised_ids: list[list[int]], *, temperature: float, seed: int,
             max_new_tokens: int) -> list[StepSample | None]:
    if temperature <= 0:
        raise CRRError(f"the tempered proposal needs T_cf > 0, got {temperature}")
    samples = backend.generate(conversations, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
                               exclude=list(realised), exclude_ids=list(realised_ids))
    return [None if s.exclusion_failed or _canonical(s.text) == _canonical(a) else s
            for s, a in zip(samples, realised)]


def validity_filtered(backend: GenerationBackend, conversations: list[list[dict]], realised: list[str],
                      realised_ids: list[list[int]], *, temperature: float, seed: int,
                      max_new_tokens: int) -> list[StepSample | None]:
    out = tempered(backend, conversations, realised, realised_ids, temperature=temperature, seed=seed,
                   max_new_tokens=max_new_tokens)
    for attempt in range(1, VALIDITY_RESAMPLES + 1):
        redo = [i for i, s in enumerate(out) if s is not None and _canonical(s.text) is None]
        if not redo:
            break
        again = tempered(backend, [conversations[i] for i in redo], [realised[i] for i in redo],
                         [realised_ids[i] for i in redo], temperature=temperature, seed=derive_seed(seed, attempt),
                         max_new_tokens=max_new_tokens)
        for i, s in zip(redo, again):
            out[i] = s
    return [s if s is not None and _canonical(s.text) is not None else None for s in out]


def on_policy(backend: GenerationBackend, conversations: list[list[dict]], realised: list[str],
              realised_ids: list[list[int]], *, temperature: float, seed: int,
              max_new_tokens: int) -> list[StepSample | None]:
    return backend.generate(conversations, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)


PROPOSALS: dict[str, Callable[..., list[StepSample | None]]] = {"tempered": tempered,
                                                                "validity_filtered": validity_filtered,
                                                                "on_policy": on_policy}


def get_proposal(name: str) -> Callable[..., list[StepSample | None]]:
    if name not in PROPOSALS:
        raise CRRError(f"unknown proposal {name!r}; choose one of {', '.join(PROPOSALS)}")
    return PROPOSALS[name]
