"""Injected replay noise rho (paper: Appendix "Controlled replay-noise sensitivity", Table
"supp-tab-noise"): a fraction rho of the steps replayed in counterfactual branches receives an output
resampled from the recorded rerun distribution instead of the output the forked sandbox produced.

The recorded rerun distribution of an action is every output the same action (same canonical call) gave
on the same task in this iteration's realised trajectories: the G siblings re-run the same calls from
different states, which is the spread a non-deterministic environment would show. Only what the agent
reads changes; the sandbox state, and so the verifier's return, stays real. An action with no recorded
output keeps its own (there is nothing to resample from), so the realised injection rate (Step.resampled)
is logged next to rho. Draws are seeded per (branch, step): the same seed injects the same noise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from crr.agent.episode import Trajectory
from crr.agent.tools import Observation, ToolCall

Perturb = Callable[[int, ToolCall, Observation], Observation]   # (step index, call, real output) -> output seen


class RerunOutputs:
    def __init__(self, trajs: list[Trajectory], rho: float, seed: int):
        self.rho, self.seed = rho, seed
        outputs: dict[tuple[str, str], set[str]] = {}
        for traj in trajs:
            for s in traj.steps:
                if s.call is not None and not s.is_error and not s.terminal:
                    key = (traj.task_id, ToolCall(s.call["name"], s.call["arguments"]).canonical())
                    outputs.setdefault(key, set()).add(s.observation)
        self.outputs = {k: sorted(v) for k, v in outputs.items()}   # sorted: draws independent of set order

    def for_branch(self, task_id: str, branch: tuple[int, ...]) -> Perturb | None:
        """The observation hook of one branch (None when rho is 0: nothing to inject)."""
        if self.rho == 0.0:
            return None

        def perturb(t: int, call: ToolCall, obs: Observation) -> Observation:
            rng = np.random.default_rng([self.seed, *branch, t])
            choices = self.outputs.get((task_id, call.canonical()))
            if obs.is_error or obs.terminal or not choices or rng.random() >= self.rho:
                return obs
            return dataclasses.replace(obs, text=choices[int(rng.integers(len(choices)))])

        return perturb
