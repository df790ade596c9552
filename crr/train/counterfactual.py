"""Counterfactual branches (paper: Algorithm 1, lines 5-9): for each selected step t of a realised
trajectory, K times: sample a_t~ from the proposal, fork the sandbox at s_t, play a_t~ there, continue on
policy to the end (or for h more steps), and score the branch with the verifier.

All branches of an iteration advance together, one batched generation per round, with their tool calls
run by the worker pool: after the proposal's round they are driven by the rollouts' episode driver
(crr.rollout.drive), and each is forked by `Episode.fork`. Each branch is an Episode whose
trajectory starts with the realised prefix a_0..a_{t-1} (so the turn cap H counts from s_0 and the
branch's token stream is a full trajectory, which Search-Select can train on) and whose sandbox and
conversation are the fork's. A branch computes only what is new in it: its prompt at s_t is a prefix
of the realised conversation, whose keys and values the rollout left in the backend's prefix cache
(crr.policy.prefix_cache; the excluded call's probability is scored on them too). The sandbox work
runs beside the generation: the restores of s_t while the proposals are sampled, the verifier of the
branches that ended in a round while the next round is generated. Seconds are charged to the ledger
as wall clock, each second once: generation (proposal and continuation) and what overlaps it to
cf_rollout_s, the restores' seconds beyond the proposals to fork_s (plus the fork-cost surcharge of
their measured seconds), the verifier's seconds beyond the generation to cf_test_s.

`continuations` is the same machinery for Monte-Carlo values (VinePPO, arXiv 2410.01679): K on-policy
continuations from a fork of every non-terminal s_t of every scored trajectory, their first action drawn
from pi at the rollout temperature (the `on_policy` proposal) instead of from an alternative-action
proposal; their seconds and tokens go to the same ledger phases and counts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from crr.agent.episode import Episode, EpisodeConfig, Trajectory
from crr.policy.backend import GenerationBackend, StepSample
from crr.sandbox.base import ForkEngine
from crr.rollout import WorkerPool, drive, in_background, sample_seed, timed
from crr.train.ledger import Ledger
from crr.train.proposals import get_proposal
from crr.train.replay_noise import RerunOutputs
from crr.train.selectors import Selection

log = logging.getLogger(__name__)


@dataclass
class Branch:
    row: int                         # index of the realised trajectory
    t: int
    k_index: int
    selection: Selection
    sample: StepSample | None        # the counterfactual action; None: the proposal skipped this index
    traj: Trajectory | None = None   # prefix + branch; None when skipped or the fork failed
    error: str | None = None

    @property
    def reward(self) -> float | None:
        return None if self.traj is None else self.traj.reward


def run_branches(trajs: list[Trajectory], picks: dict[int, list[Selection]], *, cf_samples: int,
                 backend: GenerationBackend, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
                 episode: EpisodeConfig, proposal: str, cf_temperature: float, seed: int, horizon: int | None,
                 pool: WorkerPool, ledger: Ledger, noise: RerunOutputs | None = None) -> list[Branch]:
    branches = [Branch(row, sel.t, k, sel, None) for row in sorted(picks) for sel in picks[row]
                for k in range(cf_samples)]
    if not branches:
        return []
    propose = get_proposal(proposal)
    config = dataclasses.replace(episode, snapshots=False, digests=False)
    episodes: dict[int, Episode] = {}   # branch index -> its episode, from the moment its sandbox exists

    def fork(i: int) -> None:
        b = branches[i]
        # the horizon h shortens a branch's turn cap to h steps after a_t
        cap = config if horizon is None else dataclasses.replace(config, max_turns=min(config.max_turns, b.t + 1 + horizon))
        episodes[i] = Episode.fork(trajs[b.row], b.t, engine, tokenizer, cap)
        if noise is not None:
            episodes[i].observe = noise.for_branch(trajs[b.row].task_id, (b.row, b.t, b.k_index))

    try:
        # every s_t is restored in the worker pool while the proposals are generated (they need no sandbox);
        # a branch whose proposal is skipped loses its restore, which is rare (the policy always picked a_t)
        with in_background(lambda: timed(lambda: pool.map(fork, range(len(branches))))) as forking:
            with ledger.phase("cf_rollout_s"):
                t0 = time.perf_counter()
                samples = propose(backend, [trajs[b.row].conversation(tokenizer, b.t).token_ids() for b in branches],
                                  [trajs[b.row].steps[b.t].action for b in branches],
                                  [trajs[b.row].steps[b.t].action_ids for b in branches], temperature=cf_temperature,
                                  seed=sample_seed(seed, 0), max_new_tokens=episode.max_new_tokens)
                proposal_s = time.perf_counter() - t0
            with ledger.phase("fork_s"):   # what the restores add to the wall clock beyond the proposals
                _, fork_s = forking.result()
        ledger.charge_fork_cost(fork_s + sum((s.snapshot_ms or 0.0) / 1e3 for t in trajs for s in t.steps))
        for i, (b, s) in enumerate(zip(branches, samples)):
            b.sample = s
            if s is None:
                skipped = episodes.pop(i)
                if skipped.sandbox is not None:
                    skipped.sandbox.close()
            elif episodes[i].sandbox is None:
                b.error = episodes.pop(i).traj.infra_error
        with ledger.phase("cf_rollout_s"):
            pool.map(lambda i: episodes[i].act(branches[i].sample.text, branches[i].sample.action_ids,
                                               branches[i].sample, sample_seed(seed, 0), proposal_s), list(episodes))
        playing = sorted(episodes)   # the branches on policy from a_t~ on, in branch order

        def scored(j: int, traj: Trajectory) -> None:
            branches[playing[j]].traj = traj

        # round 0 was the proposal's; the verifier of the branches that end in a round runs while the next
        # round is generated (charged to generation), cf_test_s is only what outlasts it
        drive([episodes[i] for i in playing], backend, pool, config, seed, first_round=1, on_end=scored,
              generating=lambda: ledger.phase("cf_rollout_s"), scoring=lambda: ledger.phase("cf_test_s"))
    except BaseException:
        for e in episodes.values():
            if e.sandbox is not None and not e.done:
                e.sandbox.close()
        raise
    return branches


def continuations(trajs: list[Trajectory], *, samples: int, backend: GenerationBackend, engine: ForkEngine,
                  tokenizer: PreTrainedTokenizerBase, episode: EpisodeConfig, seed: int, pool: WorkerPool,
                  ledger: Ledger, noise: RerunOutputs | None = None) -> list[Branch]:
    """`samples` on-policy continuations from every non-terminal state of every scored trajectory."""
    points = {i: [Selection(s.t, 0.0) for s in t.steps if not s.terminal]
              for i, t in enumerate(trajs) if t.reward is not None}
    return run_branches(trajs, points, cf_samples=samples, backend=backend, engine=engine, tokenizer=tokenizer,
                        episode=episode, proposal="on_policy", cf_temperature=episode.temperature, seed=seed,
                        horizon=None, pool=pool, ledger=ledger, noise=noise)
