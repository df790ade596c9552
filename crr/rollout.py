"""The rollout engine: G on-policy trajectories per task, run together (paper: Algorithm 1, "Sample G
on-policy trajectories"; Method, "Implementation": rollout and fork workers in logical pools).

    result = rollout(tasks, backend, engine, tokenizer, RolloutConfig(group_size=8, seed=11), run=RunDir.create(...))
    job = start_rollout(model_dir, "micro-test", n=4, out=Path("results/runs"))   # `crr rollout`
    result = job.execute()
    job = resume_rollout(run_dir)    # `crr rollout --resume RUN_DIR`: an interrupted one plays what it lacks

It lives at the top of the package, not in crr/agent/, because it joins the agent (episodes), the
policy (one generation backend), the fork engine, a worker pool and the run directory.

The episode driver `drive` runs the rounds, for rollouts (and so evaluation and the credit audit), for
counterfactual branches and continuations (crr.train.counterfactual), and for scripted episodes (the
expert's: `run_episode` with crr.policy.scripted.ScriptedBackend). Every round, each episode still
running contributes one conversation to a single `backend.generate` call (the whole batch: the efficient
shape for a KV-cached model on CPU and for vLLM on GPU); the sampled tool calls are then executed
concurrently by a pool of workers (threads here: sandboxes run commands as separate processes, so threads
overlap them well; `WorkerPool` is the seam for Ray).
Episodes that end are scored in the pool while the next round generates, and appended to
`trajectories.jsonl` in the run directory as they finish, in a deterministic order; `summary.json` follows
at the end.

Determinism: one seed drives every sampling seed. Round r's generation uses
`sample_seed(seed, r)`; the batch is the episodes still running, in (task, sibling) order, and which
episodes run depends only on earlier samples and (deterministic) tool outputs, so two runs with the
same seed, tasks and group size produce identical trajectories on CPU. A trajectory is a function of its
batch as well as the seed: numerics of batched matmuls are not batch-invariant, so the same task with a
different G or other tasks in the batch samples differently.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from crr.agent.episode import Episode, EpisodeConfig, Trajectory
from crr.agent.verdicts import Verdicts
from crr.errors import CRRError
from crr.policy import check_model
from crr.policy.backend import GenerationBackend, StepSample, TransformersBackend
from crr.policy.model import agent_record, load_policy
from crr.policy.scripted import ScriptedCall
from crr.sandbox import engine_spec, engine_workers, get_engine
from crr.sandbox.base import ForkEngine
from crr.rundir import RunDir, as_made
from crr.seeds import check_seed, derive_seed
from crr.tasks.loaders import load_tasks
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

TRAJECTORIES_FILE = "trajectories.jsonl"
T = TypeVar("T")
R = TypeVar("R")


class WorkerPool(Protocol):
    """Runs a function over items concurrently and returns the results in order (exceptions propagate).
    Threads now; a Ray pool implements the same two methods."""

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]: ...

    def close(self) -> None: ...


class ThreadWorkerPool:
    def __init__(self, workers: int):
        if workers < 1:
            raise CRRError(f"workers must be at least 1, got {workers}")
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="crr-rollout")

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        return list(self._executor.map(fn, items))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


DEFAULT_WORKERS = 4   # concurrent tool executions, unless given (a Ray engine: its sandbox slots)


def rollout_pool(engine: ForkEngine, workers: int | None = None) -> ThreadWorkerPool:
    """The worker pool of rollouts (and forks) on `engine`: `workers` threads, or when not given the
    engine's sandbox slots (a Ray engine: the cluster's), else DEFAULT_WORKERS."""
    return ThreadWorkerPool(engine_workers(engine, workers, DEFAULT_WORKERS))


@dataclass
class RolloutConfig:
    group_size: int = 8            # G: trajectories per task
    seed: int = 0
    workers: int | None = None     # concurrent tool executions (None: DEFAULT_WORKERS, or a Ray engine's slots)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise CRRError(f"group_size (G) must be at least 1, got {self.group_size}")
        check_seed(self.seed)
        if self.workers is not None and self.workers < 1:
            raise CRRError(f"workers must be at least 1, got {self.workers}")
        if not 0 <= self.episode.temperature < math.inf:   # (nan too)
            raise CRRError(f"temperature must be a finite number >= 0, got {self.episode.temperature}")


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]   # in (task, sibling) order
    summary: dict

    def release(self) -> None:
        """Free every trajectory's snapshots."""
        for traj in self.trajectories:
            traj.release()


def sample_seed(seed: int, round_index: int) -> int:
    """The generation seed of round `round_index`: a deterministic function of the rollout seed."""
    return derive_seed(seed, round_index)


def rollout(tasks: Iterable[Task], backend: GenerationBackend, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
            config: RolloutConfig | None = None, *, run: RunDir | None = None, pool: WorkerPool | None = None,
            on_trajectory: Callable[[Trajectory], None] | None = None, join: Join | None = None,
            verdicts: Verdicts | None = None, done: Sequence[Trajectory] = ()) -> RolloutResult:
    """Run G trajectories of every task; write each to `run` as it finishes; return them and a summary.

    The trajectories keep their snapshots (for `fork_at`) until `release()`; the engine and pool are the
    caller's (when none is given, `rollout_pool(engine, config.workers)` is made here and closed). `join`
    adds episodes to the rounds as they run (`drive`; the trainer's forks during the rollout): the result
    holds the G trajectories per task only. `verdicts` (crr.agent.verdicts): a run's verdicts by final state,
    which spare the test run of an episode that ends where an earlier one ended. `done`: the trajectories a
    resumed run already holds; their (task, sibling) pairs are not played again, and the result and summary
    hold them too (its throughput figures count what was played here).
    """
    config = config or RolloutConfig()
    tasks = list(tasks)
    if not tasks:
        raise CRRError("no tasks to roll out")
    ecfg = config.episode
    have = {(t.task_index, t.sibling) for t in done}
    episodes = [Episode(task, engine, tokenizer, ecfg, task_index=i, sibling=g, seed=config.seed, verdicts=verdicts)
                for i, task in enumerate(tasks) for g in range(config.group_size) if (i, g) not in have]
    # Reused prefixes change a row's numbers by rounding only, but a rollout's trajectories should be a
    # function of its seed and the weights alone, whatever the backend generated before.
    backend.clear_cache()
    own_pool = pool is None
    pool = pool or rollout_pool(engine, config.workers)
    finished: dict[int, Trajectory] = {}
    start = time.monotonic()

    def finish(k: int, traj: Trajectory) -> None:
        finished[k] = traj
        if run is not None:
            run.append(TRAJECTORIES_FILE, traj.to_dict())
        if on_trajectory is not None:
            on_trajectory(traj)

    try:
        pool.map(Episode.start, episodes)
        gen_s = drive(episodes, backend, pool, ecfg, config.seed, on_end=finish, join=join)
    except BaseException:
        if own_pool:
            pool.close()  # let the actions in flight end (their own timeouts) before closing their sandboxes
        for e in episodes:  # nothing outlives an interrupted rollout
            if e.sandbox is not None:
                e.sandbox.close()
            e.traj.release()
        raise
    finally:
        if own_pool:
            pool.close()
    played = [finished[k] for k in range(len(episodes))]
    trajectories = sorted([*done, *played], key=lambda t: (t.task_index, t.sibling))
    summary = summarise(trajectories, wall_s=time.monotonic() - start, gen_s=gen_s, played=played)
    if run is not None:
        run.write_json("summary.json", summary)
        run.log_metrics({"event": "rollout", **{k: v for k, v in summary.items() if not isinstance(v, dict)}})
    return RolloutResult(trajectories, summary)


def run_episode(task: Task, backend: GenerationBackend, engine: ForkEngine, tokenizer: PreTrainedTokenizerBase,
                config: EpisodeConfig | None = None, seed: int = 0) -> Trajectory:
    """One trajectory: `rollout` with one task and G = 1, on one worker. With a ScriptedBackend
    (crr.policy.scripted) it is a scripted trajectory: the expert's, the fork bench's."""
    cfg = RolloutConfig(group_size=1, seed=seed, episode=config or EpisodeConfig(), workers=1)
    return rollout([task], backend, engine, tokenizer, cfg).trajectories[0]


@dataclass
class PolicyRollout:
    """`crr rollout`'s work, ready to run: the policy loaded, its tasks, the run directory made (and, resumed,
    the trajectories it already holds)."""
    run: RunDir
    tasks: list[Task]
    backend: GenerationBackend
    tokenizer: PreTrainedTokenizerBase
    config: RolloutConfig
    engine: str
    engine_options: dict
    done: list[Trajectory] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The trajectories left to play."""
        return len(self.tasks) * self.config.group_size - len(self.done)

    def execute(self, on_trajectory: Callable[[Trajectory], None] | None = None) -> RolloutResult:
        """`rollout` on a fork engine of its own, closed at the end."""
        engine = get_engine(self.engine, **self.engine_options)
        try:
            return rollout(self.tasks, self.backend, engine, self.tokenizer, self.config, run=self.run,
                           on_trajectory=on_trajectory, done=self.done)
        finally:
            engine.close()


def start_rollout(model: str, tasks: str, n: int, out: Path, *, group_size: int = 8, seed: int = 0,
                  workers: int | None = None, engine: str = "local", engine_options: dict | None = None,
                  mode: str | None = None,
                  ray: str | None = None, temperature: float = 0.6,
                  max_turns: int | None = None, max_new_tokens: int = 512, agent_format: str | None = None,
                  max_value_chars: int | None = None, time_limit: float = 3600.0) -> PolicyRollout:
    """The policy at `model` on the first `n` of `tasks`: the episodes as it was trained to see them (its
    recorded agent format and turn cap H, unless given), a run directory under `out` with the config."""
    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    opts = engine_spec(engine, engine_options, ray=ray, mode=mode).options
    # The settings as given are checked before the task set (a named set is generated on its first use) and the
    # model are loaded, so that a bad value is refused at once. Nothing forks here, so no snapshots.
    check_model(model, f"--model {model}", adapter=False)
    given = {"agent_format": agent_format, "max_turns": max_turns}
    config = RolloutConfig(group_size=group_size, seed=seed, workers=workers, episode=EpisodeConfig(
        temperature=temperature, max_new_tokens=max_new_tokens, time_limit_s=time_limit, snapshots=False,
        **{k: v for k, v in given.items() if v is not None}))
    task_list = _tasks(tasks, n)
    policy, tokenizer = load_policy(model)
    record = agent_record(model)   # the episodes as the model was trained to see them, where not given
    config.episode = dataclasses.replace(
        config.episode, agent_format=agent_format or record.get("agent_format", "paper"),
        max_turns=record.get("max_turns", 50) if max_turns is None else max_turns,
        max_context_tokens=getattr(policy.config, "max_position_embeddings", None))
    backend = TransformersBackend(policy, tokenizer, max_value_chars=max_value_chars)
    run = RunDir.create("rollout", f"n{len(task_list)}-g{group_size}-seed{seed}", root=out, seeds={"rollout": seed},
                        config={"model": model, "tasks": tasks, "n": n, "engine": engine, "engine_options": opts,
                                "mode": mode, "ray": ray, "max_value_chars": max_value_chars,
                                **dataclasses.asdict(config)})
    return PolicyRollout(run, task_list, backend, tokenizer, config, engine, opts)


def resume_rollout(path: Path | str) -> PolicyRollout:
    """An interrupted `crr rollout`, with the settings it was started with: `execute` plays only the (task,
    sibling) pairs its trajectories.jsonl lacks (a record torn by a kill is played again), with the same seed
    (the rounds' batches are smaller, so those trajectories are other draws than an uninterrupted run's)."""
    run = RunDir.open(path)
    if run.manifest.get("command") != "rollout":
        raise CRRError(f"{path} is a `crr {run.manifest.get('command')}` run, not a rollout; --resume takes a "
                       "directory made by crr rollout")
    run.lock()
    given = run.config
    try:
        config = RolloutConfig(group_size=given["group_size"], seed=given["seed"], workers=given["workers"],
                               episode=EpisodeConfig(**given["episode"]))
        model, tasks, n = as_made(run.path, given["model"]), as_made(run.path, given["tasks"]), given["n"]
        engine, opts, max_value_chars = given["engine"], given["engine_options"], given["max_value_chars"]
    except (KeyError, TypeError) as e:   # keys missing or unknown
        raise CRRError(f"{run.path / 'config.yaml'} is corrupt (not a rollout's config: {e})") from None
    task_list = _tasks(tasks, n)
    done = [Trajectory.from_dict(d) for d in run.records(TRAJECTORIES_FILE)]
    for t in done:
        if not (t.task_index < len(task_list) and task_list[t.task_index].instance_id == t.task_id
                and 0 <= t.sibling < config.group_size):
            raise CRRError(f"{run.path / TRAJECTORIES_FILE} holds {t.task_id} #{t.sibling} at task {t.task_index}, "
                           f"which {tasks} (the first {n}) does not have there: the task set has changed since")
    policy, tokenizer = load_policy(model)
    backend = TransformersBackend(policy, tokenizer, max_value_chars=max_value_chars)
    return PolicyRollout(run, task_list, backend, tokenizer, config, engine, opts, done)


def _tasks(tasks: str, n: int) -> list[Task]:
    task_list = load_tasks(tasks)[:n]
    if not task_list:
        raise CRRError(f"{tasks} holds no tasks")
    return task_list


class Join(Protocol):
    """Episodes that join a drive while it runs (the trainer's forks of states as they are realised,
    crr.train.counterfactual.LiveForks). Called after every round with the episodes that played in it and
    those that ended before it (by drive key), the round's generation-and-play seconds and its wait for their
    scoring; returns started episodes, which play from the next round on."""

    def __call__(self, played: dict[int, Episode], ended: dict[int, Episode], gen_s: float,
                 wait_s: float) -> list[Episode]: ...


def drive(episodes: list[Episode], backend: GenerationBackend, pool: WorkerPool, config: EpisodeConfig, seed: int,
          *, first_round: int = 0, on_end: Callable[[int, Trajectory], None] | None = None,
          generating: Callable[[], AbstractContextManager] = nullcontext,
          scoring: Callable[[], AbstractContextManager] = nullcontext, join: Join | None = None) -> float:
    """The episode driver: advance started `episodes` round by round until every one has ended; returns the
    seconds spent generating. Each round, the episodes still running (in list order) contribute their
    conversations to one `backend.generate` call, sampled with `sample_seed(seed, round)` (rounds count from
    `first_round`), and the calls are played in the worker pool (`play_sample`). The episodes that ended in a
    round are scored (`Episode.finish`) in the pool while the next round is generated (the verifier is sandbox
    processes, generation is the model: on separate cores they overlap); `on_end(index, trajectory)` then gets
    them in list order. `generating` and `scoring` are the contexts a round's generation and play, and the wait
    for its scoring, run in (the trainer's ledger phases: so each second is charged once, and the verifier only
    for what outlasts the generation). The episodes `join` returns after a round run behind the given ones
    (keys from len(episodes) on; `on_end` is not called for them) and are closed if the drive fails."""
    running = dict(enumerate(episodes))   # in key order, as rounds remove the ended ones
    joined: list[Episode] = []
    round_index, gen_s = first_round, 0.0
    try:
        while running:
            for e in running.values():
                e.check_limits()
            ending = {k: running.pop(k) for k in [k for k, e in running.items() if e.done]}
            active: dict[int, Episode] = {}
            with in_background(functools.partial(pool.map, Episode.finish, list(ending.values()))) as scoring_round:
                t0 = time.perf_counter()
                if running:
                    active = dict(running)
                    with generating():
                        round_seed = sample_seed(seed, round_index)
                        t1 = time.perf_counter()
                        samples = backend.generate([e.conversation.token_ids() for e in active.values()],
                                                   temperature=config.temperature, seed=round_seed,
                                                   max_new_tokens=config.max_new_tokens,
                                                   drafts=[e.draft_source() for e in active.values()]
                                                   if config.drafts else None)
                        elapsed = time.perf_counter() - t1
                        gen_s += elapsed
                        pool.map(functools.partial(play_sample, seed=round_seed, gen_s=elapsed),
                                 list(zip(active.values(), samples)))
                    round_index += 1
                t1 = time.perf_counter()
                with scoring():
                    trajs = scoring_round.result()
                t2 = time.perf_counter()
            for k, traj in zip(ending, trajs):
                if on_end is not None and k < len(episodes):
                    on_end(k, traj)
            if join is not None:
                for e in join(active, ending, t1 - t0, t2 - t1):
                    running[len(episodes) + len(joined)] = e
                    joined.append(e)
    except BaseException:
        for e in joined:   # the given episodes are their owner's to close
            if e.sandbox is not None and not e.done:
                e.sandbox.close()
        raise
    return gen_s


def play_sample(pair: tuple[Episode, StepSample | ScriptedCall], seed: int, gen_s: float) -> None:
    """Play a generated call in its episode (a worker's job, for rollouts and counterfactual branches); a
    script's call (crr.policy.scripted) is played with no generation record: no sample, seed or time."""
    episode, sample = pair
    if isinstance(sample, ScriptedCall):
        episode.act(sample.text, sample.action_ids)
    else:
        episode.act(sample.text, sample.action_ids, sample, seed, gen_s)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn() and its seconds."""
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


@contextmanager
def in_background(fn: Callable[[], T]) -> Iterator[Future[T]]:
    """`fn` runs in a helper thread while the block runs; leaving the block waits for it (also when the
    block raises, so nothing it started outlives the caller's clean-up). A helper thread rather than the
    worker pool itself: WorkerPool offers a blocking map only (the Ray seam), which the helper calls."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="crr-drive") as helper:
        yield helper.submit(fn)


def summarise(trajectories: list[Trajectory], wall_s: float, gen_s: float,
              played: list[Trajectory] | None = None) -> dict:
    """Pass rate over the trajectories the verifier scored (infrastructure failures excluded), token
    counts, and the throughput of those `played` in wall_s (default: all of them)."""
    played = trajectories if played is None else played
    scored = [t for t in trajectories if t.reward is not None]
    steps = [s for t in trajectories for s in t.steps]
    generated = sum(len(s.action_ids) for s in steps)
    generated_here = sum(t.generated_tokens for t in played)
    return {
        "trajectories": len(trajectories),
        "scored": len(scored),
        "passed": sum(t.reward == 1.0 for t in scored),
        "pass_rate": sum(t.reward for t in scored) / len(scored) if scored else None,
        "infra_errors": len(trajectories) - len(scored),
        "end_reasons": dict(Counter(t.end_reason for t in trajectories)),
        "steps": len(steps),
        "mean_turns": len(steps) / len(trajectories),
        "error_observations": sum(s.is_error for s in steps),
        "truncated_calls": sum(s.truncated for s in steps),
        "generated_tokens": generated,
        "completion_tokens": sum(len(t.completion_ids) for t in trajectories),
        "grammar_rejection_rate": sum(s.grammar_rejections for s in steps) / generated if generated else None,
        "context_mismatches": sum(s.context_matches is False for s in steps),
        "wall_s": wall_s,
        "generation_s": gen_s,
        "played": len(played),
        "generated_tokens_per_s": generated_here / gen_s if gen_s else None,
        "trajectories_per_min": 60 * len(played) / wall_s if wall_s else None,
    }
