"""The episode loop: one trajectory tau = (s_0, a_0, ..., s_T, a_T) of a task in a sandbox, and forking
it at any step index later (paper: Preliminaries; Algorithm 1, "Snapshot sandbox state sigma(s_t)";
Appendix "Rollout-Dispatch Cost Breakdown").

    traj = run_episode(task, backend, engine, tokenizer, EpisodeConfig(max_turns=50), seed=0)  # crr.rollout
    with fork_at(traj, t=5) as sandbox:      # a sandbox in state s_5 (before a_5)
        ...
    traj.release()                           # frees the snapshots

Each turn is one generated tool call (crr.rollout batches the calls of many episodes into one
generation; `crr.rollout.run_episode` is that loop for a single one: the rollout engine sits above the
episode, so the single-episode helper lives there too). A call that does not parse or was cut off by
the token budget becomes an error observation the model reads next turn, never a crash. submit_patch
or the turn cap H ends the episode, as do the per-trajectory wall-clock limit and the model's context
length; the verifier then scores the final state: R in {0, 1}, or None with `infra_error` when the
sandbox failed (a SandboxError, a sandbox gone from under the loop): infrastructure failures are
labelled and excluded from rewards, never counted as 0. Each command is held to its tool's own timeout.

Forking at step t. The CRR selector picks indices after the episode, so the state s_t of any step must
stay reachable. The strategies, measured with `crr rollout bench --only fork`: a 45-step scripted
trajectory on a micro task (edit a file, view, a shell command, the tests, repeated), medians of 3-5,
on 2 cores shared with other work (load average 5-7, so ranges over runs):

  snapshot every step (chosen)   sigma(s_t) before each non-terminal action. An overlay snapshot copies
                                 only the diff: 0.5-0.8 ms a step (local and Docker overlay), ~30 ms for
                                 a 50-turn episode. fork_at(t) is one restore, flat in t: local 2.5 ms at
                                 t=5 and t=40 on the quietest run (36-96 ms at load 6.6), plus 20-65 ms
                                 for the fork's first command; Docker overlay 32 ms at t=5 and 53 ms at
                                 t=40 including the first command. Exact: tree digests equal.
  lazy snapshots                 not possible on its own: the selector runs after the episode, so a
                                 state not snapshotted when it was live can only be rebuilt by replay.
  replay the prefix              a fresh sandbox, a_0..a_{t-1} re-executed, then the tree digest checked
                                 against the one recorded at s_t. Recording costs a digest per step
                                 (50-160 ms: a Python process walking the tree); fork_at(t) costs the
                                 prefix's commands, linear in t: local 1.6-4.8 s at t=5 and 10.8-19.6 s
                                 at t=40 (Docker overlay 2.5 s and 15.3 s), and it is exact only where
                                 the prefix's commands are deterministic.

So episodes snapshot every step (`snapshots=True`) and fork by restore, two to three orders of magnitude
faster than replay at t=40. With `digests=True` they also record tree digests, and `fork_at` falls back
to verified replay when the snapshots are gone (released, or a trajectory read back from JSONL after its
engine closed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from transformers import PreTrainedTokenizerBase

from crr.agent.conversation import Conversation, initial_messages
from crr.agent.prompt import DEFAULT_MAX_TURNS, agent_format
from crr.agent.tools import (
    Observation,
    ToolCall,
    ToolCallError,
    execute,
    parse_tool_call,
    tool_type_score,
    truncate,
)
from crr.agent.verdicts import Verdicts
from crr.agent.verifier import VERIFY_TIMEOUT_S, verify
from crr.errors import CRRError, SandboxError
from crr.policy.backend import StepSample
from crr.sandbox.base import ForkEngine, Sandbox, Snapshot, tree_digest
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

END_REASONS = ("submit", "max_turns", "time_limit", "context_limit", "infra_error")
_RUNTIME = ("task", "engine", "snapshots")  # Trajectory fields that are handles, not data


@dataclass
class EpisodeConfig:
    max_turns: int = DEFAULT_MAX_TURNS   # H, the paper's turn cap
    temperature: float = 0.6             # training rollouts; 0 is greedy (pass@1 evaluation)
    max_new_tokens: int = 512            # per action; a call cut off here becomes an error observation
    time_limit_s: float = 3600.0         # per trajectory, wall clock (each command also has its own timeout)
    max_context_tokens: int | None = None  # None: the tokenizer's model_max_length
    snapshots: bool = True               # snapshot s_t before every non-terminal action (fork by restore)
    digests: bool = False                # record tree_digest(s_t) per step (verified replay fallback)
    verify_timeout_s: float = VERIFY_TIMEOUT_S
    agent_format: str = "paper"          # crr.agent.prompt.FORMATS: prompt, tool catalogue, observation budget
    drafts: bool = True                  # decode with guesses from `Episode.draft_source` (crr.policy.drafts):
    #                                      fewer passes, the same samples

    def __post_init__(self) -> None:
        agent_format(self.agent_format)  # a clear error for an unknown name
        if self.max_turns < 1:
            raise CRRError(f"max_turns must be at least 1, got {self.max_turns}")
        if self.max_new_tokens < 1:
            raise CRRError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.time_limit_s > 0:   # (nan too)
            raise CRRError(f"time_limit_s must be positive, got {self.time_limit_s}")


@dataclass
class Step:
    """One decision a_t with everything the trainer and the selector need (JSON-serialisable)."""
    t: int
    action: str                       # the call's JSON as generated (partial if truncated)
    call: dict | None                 # {"name", "arguments"} if it parsed, else None
    parse_error: str | None
    observation: str
    is_error: bool                    # the call was rejected (error observation)
    terminal: bool                    # submit_patch
    action_ids: list[int]
    observation_ids: list[int]        # empty after the last action (the model never sees it)
    span: tuple[int, int]             # a_t's (start, end) in the trajectory's completion_ids
    behaviour_logprobs: list[float]
    policy_logprobs: list[float]
    entropy: float                    # H_t
    grammar_rejections: int
    truncated: bool
    tool_type: float | None           # selector type score; None for submit or a call that did not parse
    temperature: float
    sample_seed: int | None
    context_matches: bool | None      # the backend's prompt equals the token stream before a_t
    gen_s: float                      # generation time of the batch this action came from
    exec_s: float
    snapshot_ms: float | None = None  # time to snapshot s_t
    digest: str | None = None         # tree_digest(s_t), when recorded
    resampled: bool = False           # the observation is injected replay noise (crr.train.replay_noise)


@dataclass
class Trajectory:
    task_id: str
    task_index: int
    sibling: int                      # which of the task's G trajectories (0..G-1)
    seed: int
    messages: list[dict]              # the initial system and user messages
    prompt_ids: list[int]
    steps: list[Step] = field(default_factory=list)
    end_reason: str | None = None     # one of END_REASONS
    reward: float | None = None       # R(tau) in {0, 1}; None on an infrastructure failure
    infra_error: str | None = None
    resolution: str | None = None
    verifier_note: str | None = None
    model_patch: str = ""
    test_report: dict = field(default_factory=dict)  # swebench's get_eval_tests_report (error taxonomy)
    harness_files: list[str] = field(default_factory=list)  # the verifier's harness audit: non-empty -> R = 0
    wall_s: float = 0.0
    agent_format: str = "paper"       # how the conversation was rendered (crr.agent.prompt.FORMATS)
    # Runtime only (not serialised): where the snapshots of s_t live.
    task: Task | None = field(default=None, repr=False, compare=False)
    engine: ForkEngine | None = field(default=None, repr=False, compare=False)
    snapshots: dict[int, Snapshot] = field(default_factory=dict, repr=False, compare=False)

    @property
    def completion_ids(self) -> list[int]:
        return [i for s in self.steps for i in s.action_ids + s.observation_ids]

    @property
    def env_mask(self) -> list[int]:
        return [m for s in self.steps for m in [1] * len(s.action_ids) + [0] * len(s.observation_ids)]

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.action_ids) for s in self.steps)

    @property
    def observed_tokens(self) -> int:
        """The observation tokens the policy was fed (the prompt aside)."""
        return sum(len(s.observation_ids) for s in self.steps)

    def trl_row(self) -> dict:
        """One row of TRL's rollout_func: prompt_ids, completion_ids, logprobs (0.0 on observation
        tokens), env_mask, plus the step spans and the reward for the CRR advantage."""
        if any(len(s.behaviour_logprobs) != len(s.action_ids) for s in self.steps):
            raise CRRError(f"trajectory {self.task_id}[{self.sibling}] has scripted steps "
                           "(no behaviour log-probabilities)")
        logprobs = [lp for s in self.steps
                    for lp in s.behaviour_logprobs + [0.0] * len(s.observation_ids)]
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "logprobs": logprobs,
                "env_mask": self.env_mask, "step_spans": [s.span for s in self.steps], "reward": self.reward}

    def conversation(self, tokenizer: PreTrainedTokenizerBase, t: int | None = None) -> Conversation:
        """The conversation before a_t (all of it when t is None), rebuilt from the recorded ids."""
        conv = Conversation(tokenizer, self.messages, agent_format(self.agent_format).tools)
        for s in self.steps[:len(self.steps) if t is None else t]:
            conv.add_action(s.action, s.action_ids)
            if s.observation_ids:
                conv.add_observation(s.observation, s.call["name"] if s.call else None)
        return conv

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _RUNTIME}
        d["steps"] = [asdict(s) for s in self.steps]
        d["turns"] = len(self.steps)
        d["generated_tokens"] = self.generated_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = {k: v for k, v in d.items() if k not in ("turns", "generated_tokens")}
        if "group" in d:   # records written before the sibling index was named `sibling`
            d["sibling"] = d.pop("group")
        steps = [Step(**{**s, "span": tuple(s["span"])}) for s in d.pop("steps")]
        return cls(**d, steps=steps)

    def release(self) -> None:
        """Free the snapshots of this trajectory (idempotent)."""
        snapshots, self.snapshots = self.snapshots, {}
        for snap in {s.id: s for s in snapshots.values()}.values():
            self.engine.release(snap)


class Episode:
    """One trajectory in progress. The episode driver (crr.rollout.drive) advances many: `start` (or `fork`
    at s_t of a trajectory), then per turn `act` with the generated call, until `done`; then `finish` scores
    it. Each method runs in a worker thread."""

    def __init__(self, task: Task, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase, config: EpisodeConfig,
                 *, task_index: int = 0, sibling: int = 0, seed: int = 0, verdicts: Verdicts | None = None):
        self.task, self.engine, self.tokenizer, self.config = task, engine, tokenizer, config
        self.verdicts = verdicts   # the run's verdicts by final state (crr.agent.verdicts); None: always test
        self.traj = Trajectory(task.instance_id, task_index, sibling, seed, [], [], task=task, engine=engine,
                               agent_format=config.agent_format)
        self.format = agent_format(config.agent_format)
        self.sandbox: Sandbox | None = None
        self.conversation: Conversation | None = None
        self.max_context = config.max_context_tokens or tokenizer.model_max_length
        # What the agent reads of an executed call: (t, call, real output) -> output; counterfactual
        # branches set it to inject replay noise (crr.train.replay_noise), everything else reads the real one.
        self.observe: Callable[[int, ToolCall, Observation], Observation] | None = None
        self.lookahead: list[int] = []   # a branch's: its trajectory's call tokens from a_t on (draft_source)
        self._start = time.monotonic()

    @classmethod
    def fork(cls, traj: Trajectory, t: int, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
             config: EpisodeConfig, verdicts: Verdicts | None = None) -> Episode:
        """An episode standing at s_t of `traj` (a counterfactual branch before its a_t): its trajectory holds the
        prefix a_0..a_{t-1} (so the turn cap H counts from s_0), its conversation is the one before a_t and its
        sandbox a fork of s_t (`fork_at`). A failed fork is an infrastructure failure of this episode (it is
        done, with no sandbox), not a return of 0."""
        ep = cls(traj.task, engine, tokenizer, config, task_index=traj.task_index, sibling=traj.sibling, seed=traj.seed,
                 verdicts=verdicts)
        ep.traj.messages, ep.traj.prompt_ids = traj.messages, traj.prompt_ids
        ep.traj.steps = list(traj.steps[:t])
        ep.conversation = traj.conversation(tokenizer, t)
        ep.lookahead = [i for s in traj.steps[t:] for i in s.action_ids]
        try:
            ep.sandbox = fork_at(traj, t, engine)
        except CRRError as e:
            ep._infra(f"fork at step {t}: {e}")
        return ep

    def draft_source(self) -> list[int]:
        """The tokens this episode's next call may repeat (crr.policy.drafts): the tokens of its calls so far,
        then a branch's lookahead, last so that its occurrences of an n-gram are the ones drafted from: a branch
        replays much of what its trajectory did after the fork."""
        return [i for s in self.traj.steps for i in s.action_ids] + self.lookahead

    @property
    def done(self) -> bool:
        return self.traj.end_reason is not None

    def start(self) -> None:
        self._start = time.monotonic()
        try:
            self.sandbox = self.engine.start(self.task)
        except CRRError as e:
            return self._infra(f"could not start a sandbox: {e}")
        messages = initial_messages(self.task, self.sandbox.repo_dir, self.config.max_turns, self.format.name)
        self.conversation = Conversation(self.tokenizer, messages, self.format.tools)
        self.traj.messages, self.traj.prompt_ids = messages, self.conversation.prompt_ids

    def check_limits(self) -> None:
        """End the episode before the next turn if its time is up or the next call cannot fit."""
        if self.done:
            return
        if time.monotonic() - self._start > self.config.time_limit_s:
            self.traj.end_reason = "time_limit"
        elif len(self.conversation.token_ids()) + self.config.max_new_tokens > self.max_context:
            self.traj.end_reason = "context_limit"

    def act(self, text: str, action_ids: list[int] | None = None, sample: StepSample | None = None,
            sample_seed: int | None = None, gen_s: float = 0.0) -> Step | None:
        """Play a_t (its call JSON and generated ids): snapshot s_t, execute a_t, append the observation.
        `sample` carries the generation record; a scripted action has none (and, without ids, the
        tokenizer's encoding)."""
        t = len(self.traj.steps)
        start = time.perf_counter()
        try:
            call, parse_error = parse_tool_call(text), None
        except ToolCallError as e:
            call, parse_error = None, str(e)
        if sample is not None and sample.truncated:
            call, parse_error = None, f"the tool call was cut off at {len(sample.action_ids)} tokens (max_new_tokens)"
        terminal_call = call is not None and call.name == "submit_patch"
        context_matches = None if sample is None else sample.prompt_ids == self.conversation.context_ids(t)
        try:
            snapshot_ms, digest = self._record_state(t, terminal_call)
            obs = real = execute(self.sandbox, call) if call is not None else None
            if obs is not None and self.observe is not None:
                obs = self.observe(t, call, obs)
        except CRRError as e:  # the sandbox failed, not the agent
            self._infra(f"step {t}: {e}")
            return None
        if obs is None:
            observation, is_error, terminal = f"Error: {parse_error}", True, False
        else:
            observation, is_error, terminal = obs.text, obs.is_error, obs.terminal
        if self.format.obs_keep_chars is not None:
            observation = truncate(observation, self.format.obs_keep_chars)
        self.conversation.add_action(text, action_ids)
        span = self.conversation.spans[-1]
        if terminal:
            self.traj.end_reason = "submit"
        elif t + 1 >= self.config.max_turns:
            self.traj.end_reason = "max_turns"
        observation_ids = [] if self.done else self.conversation.add_observation(
            observation, call.name if call else None)
        step = Step(
            t=t, action=text, call=None if call is None else {"name": call.name, "arguments": call.arguments},
            parse_error=parse_error, observation=observation, is_error=is_error, terminal=terminal,
            action_ids=self.conversation.completion_ids[span[0]:span[1]], observation_ids=observation_ids, span=span,
            behaviour_logprobs=sample.behaviour_logprobs if sample else [],
            policy_logprobs=sample.policy_logprobs if sample else [],
            entropy=sample.entropy if sample else 0.0, grammar_rejections=sample.grammar_rejections if sample else 0,
            truncated=bool(sample and sample.truncated),
            tool_type=tool_type_score(call) if call is not None else None,
            temperature=sample.temperature if sample else 0.0, sample_seed=sample_seed,
            context_matches=context_matches, gen_s=gen_s, exec_s=time.perf_counter() - start,
            snapshot_ms=snapshot_ms, digest=digest, resampled=obs is not real)
        self.traj.steps.append(step)
        return step

    def finish(self) -> Trajectory:
        """Score the final state and close the sandbox (the snapshots stay until `release`)."""
        traj = self.traj
        if traj.end_reason is None:
            raise CRRError("finish() called on an episode that is still running")
        if traj.infra_error is None:
            result = (verify(self.sandbox, self.task, timeout=self.config.verify_timeout_s) if self.verdicts is None
                      else self.verdicts.verify(self.sandbox, self.task, traj.steps, self.config.verify_timeout_s))
            traj.reward, traj.infra_error = result.reward, result.infra_error
            traj.resolution, traj.verifier_note, traj.model_patch = result.resolution, result.note, result.model_patch
            traj.test_report, traj.harness_files = result.report, result.harness_files
        if self.sandbox is not None:
            self.sandbox.close()
        traj.wall_s = time.monotonic() - self._start
        log.info("%s[%d] %s after %d steps: reward %s%s", traj.task_id, traj.sibling, traj.end_reason,
                 len(traj.steps), traj.reward, f" (infra: {traj.infra_error})" if traj.infra_error else "")
        return traj

    def _record_state(self, t: int, terminal: bool) -> tuple[float | None, str | None]:
        """Snapshot (and digest) s_t, the state a_t acts on. Submit is never forked, so not snapshotted."""
        snapshot_ms = digest = None
        if self.config.snapshots and not terminal:
            start = time.perf_counter()
            self.traj.snapshots[t] = self.sandbox.snapshot()
            snapshot_ms = 1e3 * (time.perf_counter() - start)
        if self.config.digests:
            digest = tree_digest(self.sandbox)
        return snapshot_ms, digest

    def _infra(self, reason: str) -> None:
        log.warning("%s[%d]: infrastructure failure: %s", self.task.instance_id, self.traj.sibling, reason)
        self.traj.end_reason, self.traj.infra_error, self.traj.reward = "infra_error", reason, None


def fork_at(traj: Trajectory, t: int, engine: ForkEngine | None = None, task: Task | None = None) -> Sandbox:
    """A new sandbox in state s_t of `traj` (the state a_t acted on): a restore of the snapshot taken
    before a_t, or, when it is gone, the prefix a_0..a_{t-1} replayed in a fresh sandbox and verified
    against the recorded tree digest. The caller closes the sandbox."""
    if not 0 <= t < len(traj.steps):
        raise CRRError(f"step {t} is outside trajectory {traj.task_id}[{traj.sibling}] "
                       f"(steps 0..{len(traj.steps) - 1})")
    engine = engine or traj.engine
    if engine is None:
        raise CRRError("this trajectory holds no fork engine (read back from JSONL?); pass engine=")
    if t in traj.snapshots:
        return engine.restore(traj.snapshots[t])
    return replay_at(traj, t, engine, task)


def replay_at(traj: Trajectory, t: int, engine: ForkEngine, task: Task | None = None) -> Sandbox:
    """s_t by replay: a fresh sandbox, the recorded calls a_0..a_{t-1} executed in order, and the tree
    digest compared with the one recorded at s_t; SandboxError if the replay diverged."""
    task = task or traj.task
    if task is None or task.instance_id != traj.task_id:
        raise CRRError(f"replaying trajectory {traj.task_id} needs its task; pass task=")
    expected = traj.steps[t].digest
    if expected is None:
        raise CRRError(f"step {t} of {traj.task_id}[{traj.sibling}] has no snapshot and no recorded tree digest to "
                       "verify a replay against; run episodes with snapshots=True or digests=True")
    sandbox = engine.start(task)
    try:
        for step in traj.steps[:t]:
            if step.call is not None:
                execute(sandbox, step.action)
        digest = tree_digest(sandbox)
    except BaseException:
        sandbox.close()
        raise
    if digest != expected:
        sandbox.close()
        raise SandboxError(f"replaying {traj.task_id}[{traj.sibling}] to step {t} diverged: tree digest {digest[:12]} "
                           f"!= recorded {expected[:12]} (a nondeterministic command in the prefix?)")
    return sandbox
