"""Counterfactual branches (paper: Algorithm 1, lines 5-9): for each selected step t of a realised
trajectory, K times: sample a_t~ from the proposal, fork the sandbox at s_t, play a_t~ there, continue on
policy to the end (or for h more steps), and score the branch with the verifier.

A branch is an Episode whose trajectory starts with the realised prefix a_0..a_{t-1} (so the turn cap H
counts from s_0 and the branch's token stream is a full trajectory, which Search-Select can train on) and
whose sandbox and conversation are the fork's (`Episode.fork`). `start_branches` starts a batch of them:
the proposal round, one batched generation, with the restores of s_t running beside it in the worker
pool, then a_t~ played. A branch computes only what is new in it: its prompt at s_t is a prefix of the
realised conversation, whose keys and values the rollout left in the backend's prefix cache
(crr.policy.prefix_cache; the excluded call's probability is scored on them too). Two schedules:

  LiveForks      (forks_during_rollout=true) during the rollout: a step is forked before the next
                 round when the selector picks it from its trajectory so far, and its branches then decode
                 in the rollout's own rounds, beside the on-policy rows (crr.rollout.drive's `join`). Exact
                 for the selectors whose final pick is among their prefixes' picks (PREFIX_SELECTORS);
                 the forks a later step displaces are discarded.
  run_branches   (the default) after the rollout, every pick at once, driven in rounds of their own (any
                 selector; replay noise, which draws from the whole iteration). On 2 CPU cores the two cost
                 the same (docs/training.md): a live fork's proposal is a generation call of its own in the
                 round it starts, which costs what the rounds saved at the end. The trainer runs them beside
                 the update's first passes (branches_beside_update: crr.train.trainer).

The sandbox work runs beside the generation: the restores of s_t while the proposals are sampled, the
verifier of the branches that ended in a round while the next round is generated. Seconds are charged to
the ledger as wall clock, each second once: generation (proposal and continuation) and what overlaps it to
cf_rollout_s (during the rollout: the branches' share of each round's rows), the restores' seconds beyond
the proposals to fork_s (plus the fork-cost surcharge of their measured seconds), the verifier's seconds
beyond the generation to cf_test_s.

A branch whose alternative action a sibling already took in the same state is not played (`played_by`; the
trainer's `reuse_played`): the sibling stood where the branch would stand after a_t~ and went on with the same
policy, so its return is a draw of the branch's return, and the fork, its continuation and its test run are
spared. Same state: the same task, prompt and recorded tokens of every earlier action and observation (and
the same tree digests where recorded), which fix the sandbox as verified replay assumes (deterministic tools);
the sibling must have ended on its own (not at the wall-clock limit) within the branch's horizon. The branch
then holds the sibling's trajectory and index (`Branch.played_by`). A sibling stands for one branch of a batch
at most, so that two branches (K >= 2, or two rows forked in one state) never share one draw. Not with replay
noise (a branch reads resampled outputs, the sibling did not) or forks during the rollout (the siblings are
still running).

`continuations` is the same machinery for on-policy continuations, their first action drawn from pi at the
rollout temperature (the `on_policy` proposal) instead of from an alternative-action proposal; their seconds
and tokens go to the same ledger phases and counts. Monte-Carlo values (VinePPO, arXiv 2410.01679) continue K
times from every non-terminal s_t of every scored trajectory (`continuation_points`); resets (SRPO/RRPO, arXiv
2605.25507) M times from one state of a failed trajectory per task (`reset_points`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from crr.agent.episode import Episode, EpisodeConfig, Trajectory
from crr.agent.verdicts import Verdicts
from crr.errors import CRRError
from crr.policy.backend import GenerationBackend, StepSample
from crr.sandbox.base import ForkEngine
from crr.rollout import WorkerPool, drive, in_background, sample_seed, timed
from crr.train.ledger import Ledger
from crr.train.proposals import get_proposal
from crr.train.replay_noise import RerunOutputs
from crr.train.selectors import Selection, SelectorParams, select

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
    played_by: int | None = None     # the sibling (row) that took a_t~ in the same state: traj is its trajectory

    @property
    def reward(self) -> float | None:
        return None if self.traj is None else self.traj.reward

    @property
    def tokens(self) -> int:
        """The tokens it generated: a_t~ and its on-policy suffix (a_t~ only where a sibling played it)."""
        if self.sample is None:
            return 0
        if self.traj is None or self.played_by is not None:
            return len(self.sample.action_ids)
        return sum(len(s.action_ids) for s in self.traj.steps[self.t:])

    @property
    def observed_tokens(self) -> int:
        """The observation tokens its suffix fed the policy (none where a sibling played it)."""
        if self.sample is None or self.traj is None or self.played_by is not None:
            return 0
        return sum(len(s.observation_ids) for s in self.traj.steps[self.t:])


@dataclass
class Launch:
    """The seconds of starting a batch of branches (`start_branches`)."""
    proposal_s: float = 0.0     # the proposal round's generation
    restore_s: float = 0.0      # the restores of s_t, measured (they run beside the proposals)
    wait_s: float = 0.0         # what the restores added beyond the proposals
    play_s: float = 0.0         # playing a_t~ in the forks

    def add(self, other: Launch) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def played_by(trajs: list[Trajectory], row: int, t: int, action_ids: list[int], horizon: int | None,
              taken: set[int] = frozenset()) -> int | None:
    """The first sibling of trajs[row], outside `taken`, that stood in its state s_t and took `action_ids` there,
    with a return that is a draw of such a branch's (module doc), or None."""
    parent = trajs[row]
    for j, other in enumerate(trajs):
        if (j == row or j in taken or other.task_id != parent.task_id or other.reward is None or len(other.steps) <= t
                or other.end_reason == "time_limit" or (horizon is not None and len(other.steps) > t + 1 + horizon)
                or other.prompt_ids != parent.prompt_ids or other.steps[t].action_ids != list(action_ids)):
            continue
        if all((a.action_ids, a.observation_ids, a.digest) == (b.action_ids, b.observation_ids, b.digest)
               for a, b in zip(other.steps[:t], parent.steps[:t])):
            return j
    return None


def start_branches(branches: list[Branch], parents: list[Trajectory], *, propose: Callable, backend: GenerationBackend,
                   engine: ForkEngine, tokenizer: PreTrainedTokenizerBase, config: EpisodeConfig, cf_temperature: float,
                   horizon: int | None, seed: int, pool: WorkerPool, noise: RerunOutputs | None = None,
                   verdicts: Verdicts | None = None, siblings: list[Trajectory] | None = None,
                   ) -> tuple[dict[int, Episode], Launch]:
    """Branch i forked at s_t of parents[i] with its proposal a_t~ played: the proposal round, with every s_t
    restored in the worker pool while the proposals are generated (they need no sandbox; a branch whose
    proposal is skipped loses its restore, which is rare: the policy always picked a_t). Sets each branch's
    sample (None: skipped) and error (a failed fork), and, given the rows' `siblings` (branch.row indexes
    them), the trajectory of a branch a sibling played (`played_by`); returns the episodes of the others by
    branch index."""
    episodes: dict[int, Episode] = {}
    times = Launch()
    taken: set[int] = set()   # siblings already standing for a branch: each stands for one, so draws stay independent

    def fork(i: int) -> None:
        b = branches[i]
        # the horizon h shortens a branch's turn cap to h steps after a_t
        cap = (config if horizon is None
               else dataclasses.replace(config, max_turns=min(config.max_turns, b.t + 1 + horizon)))
        episodes[i] = Episode.fork(parents[i], b.t, engine, tokenizer, cap, verdicts)
        if noise is not None:
            episodes[i].observe = noise.for_branch(parents[i].task_id, (b.row, b.t, b.k_index))

    try:
        with in_background(lambda: timed(lambda: pool.map(fork, range(len(branches))))) as forking:
            samples, times.proposal_s = timed(lambda: propose(
                backend, [p.conversation(tokenizer, b.t).token_ids() for b, p in zip(branches, parents)],
                [p.steps[b.t].action for b, p in zip(branches, parents)],
                [p.steps[b.t].action_ids for b, p in zip(branches, parents)], temperature=cf_temperature, seed=seed,
                max_new_tokens=config.max_new_tokens))
            t0 = time.perf_counter()
            _, times.restore_s = forking.result()
            times.wait_s = time.perf_counter() - t0
        for i, (b, s) in enumerate(zip(branches, samples)):
            b.sample = s
            if s is None:
                close([episodes.pop(i)])
            elif (siblings is not None
                  and (j := played_by(siblings, b.row, b.t, s.action_ids, horizon, taken)) is not None):
                b.played_by, b.traj = j, siblings[j]
                taken.add(j)
                close([episodes.pop(i)])
            elif episodes[i].sandbox is None:
                b.error = episodes.pop(i).traj.infra_error
        _, times.play_s = timed(lambda: pool.map(
            lambda i: episodes[i].act(branches[i].sample.text, branches[i].sample.action_ids, branches[i].sample, seed,
                                      times.proposal_s), list(episodes)))
    except BaseException:
        close(episodes.values())
        raise
    return episodes, times


def close(episodes: Iterable[Episode]) -> None:
    """Close the sandboxes of episodes still running (an interrupted fork leaves none behind)."""
    for e in episodes:
        if e.sandbox is not None and not e.done:
            e.sandbox.close()


def run_branches(trajs: list[Trajectory], picks: dict[int, list[Selection]], *, cf_samples: int,
                 backend: GenerationBackend, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
                 episode: EpisodeConfig, proposal: str, cf_temperature: float, seed: int, horizon: int | None,
                 pool: WorkerPool, ledger: Ledger, noise: RerunOutputs | None = None,
                 verdicts: Verdicts | None = None, reuse_played: bool = False) -> list[Branch]:
    """The branches of every pick after the rollout: started together (`start_branches`), then driven to
    their ends in rounds of their own; with `reuse_played` (not with replay noise) a branch that a sibling
    played takes its trajectory (`played_by`)."""
    branches = [Branch(row, sel.t, k, sel, None) for row in sorted(picks) for sel in picks[row]
                for k in range(cf_samples)]
    if not branches:
        return []
    config = dataclasses.replace(episode, snapshots=False, digests=False)
    with ledger.phase("cf_rollout_s"):
        episodes, times = start_branches(branches, [trajs[b.row] for b in branches], propose=get_proposal(proposal),
                                         backend=backend, engine=engine, tokenizer=tokenizer, config=config,
                                         cf_temperature=cf_temperature, horizon=horizon, seed=sample_seed(seed, 0),
                                         pool=pool, noise=noise, verdicts=verdicts,
                                         siblings=trajs if reuse_played and noise is None else None)
    ledger.move(times.wait_s, "cf_rollout_s", "fork_s")   # what the restores add to the wall clock
    ledger.charge_fork_cost(times.restore_s + sum((s.snapshot_ms or 0.0) / 1e3 for t in trajs for s in t.steps))
    playing = sorted(episodes)   # the branches on policy from a_t~ on, in branch order

    def scored(j: int, traj: Trajectory) -> None:
        branches[playing[j]].traj = traj

    try:
        # round 0 was the proposal's; the verifier of the branches that end in a round runs while the next
        # round is generated (charged to generation), cf_test_s is only what outlasts it
        drive([episodes[i] for i in playing], backend, pool, config, seed, first_round=1, on_end=scored,
              generating=lambda: ledger.phase("cf_rollout_s"), scoring=lambda: ledger.phase("cf_test_s"))
    except BaseException:
        close(episodes.values())
        raise
    return branches


def continuation_points(trajs: list[Trajectory]) -> dict[int, list[Selection]]:
    """Where Monte-Carlo values fork: every non-terminal state of every scored trajectory."""
    return {i: [Selection(s.t, 0.0) for s in t.steps if not s.terminal] for i, t in enumerate(trajs)
            if t.reward is not None}


def reset_points(trajs: list[Trajectory], picks: dict[int, list[Selection]]) -> tuple[dict, dict]:
    """Where resets fork, one state per task: (resets, fresh). resets: the first pick of the task's first failed
    trajectory (R = 0) that has one (the siblings are i.i.d., so the first is a uniformly drawn one); fresh:
    s_0 of the first trajectory with a snapshot of it, for a task with no failure to reset from (its restart rows
    are then fresh on-policy trajectories). A task none of whose trajectories has one (each submitted at once or
    failed to start) has neither."""
    resets: dict[int, list[Selection]] = {}
    fresh: dict[int, list[Selection]] = {}
    for task in dict.fromkeys(t.task_index for t in trajs):
        rows = [i for i, t in enumerate(trajs) if t.task_index == task]
        failed = next((i for i in rows if trajs[i].reward == 0.0 and picks.get(i)), None)
        if failed is not None:
            resets[failed] = picks[failed][:1]
        elif (first := next((i for i in rows if 0 in trajs[i].snapshots), None)) is not None:
            fresh[first] = [Selection(0, 0.0)]
    return resets, fresh


def continuations(trajs: list[Trajectory], points: dict[int, list[Selection]], *, samples: int,
                  backend: GenerationBackend, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
                  episode: EpisodeConfig, seed: int, pool: WorkerPool, ledger: Ledger,
                  noise: RerunOutputs | None = None, verdicts: Verdicts | None = None,
                  reuse_played: bool = False) -> list[Branch]:
    """`samples` on-policy continuations from each of `points` (row -> the states s_t to continue from)."""
    return run_branches(trajs, points, cf_samples=samples, backend=backend, engine=engine,
                        tokenizer=tokenizer, episode=episode, proposal="on_policy", cf_temperature=episode.temperature,
                        seed=seed, horizon=None, pool=pool, ledger=ledger, noise=noise, verdicts=verdicts,
                        reuse_played=reuse_played)


class LiveForks:
    """The method's forks started during the rollout, in the round after their state is realised, so that
    the branches decode in the rollout's own batches (`crr.rollout.drive`'s `join`) instead of in rounds
    of their own after it (issue 29, section 3). A step is forked when the selector picks it from its
    trajectory so far: for a selector whose final choice is among the choices of the prefixes that hold
    it (crr.train.selectors.PREFIX_SELECTORS: top-k of a per-step score), every step it finally picks was
    forked, from the same state with the same policy and proposal as a fork after the rollout, so the
    branches have the same distribution (not the same draws: other batches, other seeds). The forks of
    steps that a later step displaced, and of trajectories the verifier could not score, are played and
    discarded (`discarded`: the price of starting early). Continuations (mc-values) fork every
    non-terminal step. Replay noise draws from the whole iteration's outputs, so it needs the forks
    after the rollout.

    Seconds: the drive's rounds are the rollout's (ledger phase rollout_s); `charge` moves to cf_rollout_s
    the branches' share of each round's generation and play (their rows over the round's rows) and their
    proposal rounds, to cf_test_s their share of the waits for the verifier, to fork_s what the restores
    added."""

    def __init__(self, *, forks: str, selector: str, params: SelectorParams, cf_samples: int, proposal: str,
                 cf_temperature: float, horizon: int | None, backend: GenerationBackend, engine: ForkEngine,
                 tokenizer: PreTrainedTokenizerBase, episode: EpisodeConfig, seed: int, pool: WorkerPool,
                 verdicts: Verdicts | None = None):
        self.forks, self.selector, self.params, self.cf_samples = forks, selector, params, cf_samples
        self.propose = get_proposal("on_policy" if forks == "continuation" else proposal)
        self.cf_temperature = episode.temperature if forks == "continuation" else cf_temperature
        self.horizon = None if forks == "continuation" else horizon
        self.backend, self.engine, self.tokenizer, self.pool, self.seed = backend, engine, tokenizer, pool, seed
        self.verdicts = verdicts
        self.config = dataclasses.replace(episode, snapshots=False, digests=False)
        self.launched: dict[tuple[int, int], list[Branch]] = {}   # (row, t) -> its K branches
        self.episodes: dict[int, tuple[Branch, Episode]] = {}     # id(episode) -> its branch
        self.rounds = 0
        self.times = Launch()
        self.share_s = self.test_s = 0.0
        self.discarded: list[Branch] = []
        self.seen: dict[int, int] = {}                             # row -> its steps already considered

    def _pick(self, steps: list) -> Selection | None:
        """The last of `steps` (just realised) as the selector picks it from them (a continuation: every
        non-terminal step, as `continuation_points`), or None."""
        t = len(steps) - 1
        if self.forks == "continuation":
            return None if steps[t].terminal else Selection(t, 0.0)
        return next((sel for sel in select(self.selector, steps, self.params) if sel.t == t), None)

    def join(self, played: dict[int, Episode], ended: dict[int, Episode], gen_s: float, wait_s: float) -> list[Episode]:
        """crr.rollout.Join: the branches' share of the round, then the forks of the states it realised."""
        if played:
            self.share_s += gen_s * sum(id(e) in self.episodes for e in played.values()) / len(played)
        if ended:
            self.test_s += wait_s * sum(id(e) in self.episodes for e in ended.values()) / len(ended)
        realised = {row: e.traj for row, e in played.items()   # a step that failed in the sandbox added none
                    if id(e) not in self.episodes and len(e.traj.steps) > self.seen.get(row, 0)}
        self.seen.update({row: len(traj.steps) for row, traj in realised.items()})
        picked = {row: (sel, traj) for row, traj in realised.items() if (sel := self._pick(traj.steps)) is not None}
        new = [(Branch(row, sel.t, k, sel, None), traj) for row, (sel, traj) in picked.items()
               for k in range(self.cf_samples)]
        self.rounds += 1
        if not new:
            return []
        branches = [b for b, _ in new]
        for b in branches:
            self.launched.setdefault((b.row, b.t), []).append(b)
        episodes, times = start_branches(branches, [p for _, p in new], propose=self.propose, backend=self.backend,
                                         engine=self.engine, tokenizer=self.tokenizer, config=self.config,
                                         cf_temperature=self.cf_temperature, horizon=self.horizon,
                                         seed=sample_seed(self.seed, self.rounds), pool=self.pool,
                                         verdicts=self.verdicts)
        self.times.add(times)
        for i, e in episodes.items():
            self.episodes[id(e)] = (branches[i], e)
        return list(episodes.values())

    def branches(self, picks: dict[int, list[Selection]]) -> list[Branch]:
        """After the rollout: the branches of `picks` (the selector's final choice), in (row, t, k) order, each
        with its trajectory; the others are `discarded`."""
        for b, e in self.episodes.values():
            b.traj = e.traj
        kept = []
        for row in sorted(picks):
            for sel in picks[row]:
                if (row, sel.t) not in self.launched:
                    raise CRRError(f"step {sel.t} of row {row} was picked but not forked during the rollout: the "
                                   f"selector {self.selector!r} is not one of crr.train.selectors.PREFIX_SELECTORS")
                kept += self.launched[(row, sel.t)]
        keys = {(row, sel.t) for row in picks for sel in picks[row]}
        self.discarded = [b for key, bs in self.launched.items() if key not in keys for b in bs]
        return kept

    def charge(self, ledger: Ledger, snapshot_s: float) -> None:
        """Move the branches' seconds out of the rollout's phase (see the class); the fork-cost surcharge."""
        ledger.move(self.share_s + self.times.proposal_s + self.times.play_s, "rollout_s", "cf_rollout_s")
        ledger.move(self.test_s, "rollout_s", "cf_test_s")
        ledger.move(self.times.wait_s, "rollout_s", "fork_s")
        ledger.charge_fork_cost(self.times.restore_s + snapshot_s)
