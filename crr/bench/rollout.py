"""Benchmarks of the rollout engine (figures for the note; never timed tests): rollout throughput of a
policy at G trajectories per task, and the latency of forking a trajectory at step index t by each
strategy of crr.agent.episode (restore the snapshot of s_t, or replay the prefix and verify it).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from crr.agent.conversation import action_text
from crr.agent.episode import EpisodeConfig, fork_at, replay_at
from crr.agent.expert import expert_script
from crr.errors import CRRError
from crr.policy.backend import TransformersBackend
from crr.policy.model import default_model_dir, load_policy
from crr.policy.scripted import ScriptedBackend
from crr.sandbox import get_engine
from crr.sandbox.base import tree_digest
from crr.rollout import RolloutConfig, rollout, run_episode
from crr.tasks.micro import generate_micro
from crr.tasks.schema import Task


def _micro_task(seed: int, workdir: Path) -> Task:
    return generate_micro(workdir / "tasks", n=1, seed=seed, split="test")[0]


def long_script(task: Task, steps: int) -> list[str]:
    """A trajectory of `steps` calls that keeps changing the tree: the expert's opening (tests, views),
    then a cycle of edits to a notes file, views and focused test runs, then submit."""
    opening = [c for c in expert_script(task) if c.name in ("run_tests", "view_file")]
    calls = [action_text(c) for c in opening]
    k = 0
    while len(calls) < steps - 1:
        k += 1
        calls += [json.dumps({"name": "edit_file", "arguments": {"path": "NOTES.md", "start": k, "end": k - 1,
                                                                 "replacement": f"note {k}"}}),
                  json.dumps({"name": "view_file", "arguments": {"path": "NOTES.md"}}),
                  json.dumps({"name": "run_shell",
                              "arguments": {"command": f"echo {k} >> scratch.txt && wc -l scratch.txt"}}),
                  json.dumps({"name": "run_tests", "arguments": {"test_filter": ""}})]
    return calls[:steps - 1] + [json.dumps({"name": "submit_patch", "arguments": {}})]


def fork_bench(engine: str = "local", steps: int = 45, at: tuple[int, ...] = (5, 40), repeats: int = 5,
               seed: int = 0, **engine_opts) -> dict:
    """Play a scripted `steps`-step trajectory on a micro task recording snapshots and digests, then time
    fork_at(t) by restore (alone, and until a first command has run in the fork) and by verified replay at
    each t in `at` (medians over `repeats`)."""
    if max(at) >= steps - 1:
        raise CRRError(f"--fork-steps must be at least {max(at) + 2}, got {steps}: the script is forked at steps "
                       f"{', '.join(map(str, at))}, before its last (submit) step")
    if repeats < 1:
        raise CRRError(f"the fork bench times at least 1 repeat, got {repeats}")
    with tempfile.TemporaryDirectory(prefix="crr-fork-bench-") as tmp, get_engine(engine, **engine_opts) as eng:
        task = _micro_task(seed, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        calls = long_script(task, steps)
        start = time.perf_counter()
        # no model reads a script's conversation, so no context window cuts it (the tokenizer's would, at about
        # 23 of the default 45 steps: the run_tests outputs fill it)
        traj = run_episode(task, ScriptedBackend(calls), eng, tokenizer,
                           EpisodeConfig(max_turns=steps, snapshots=True, digests=True, max_context_tokens=sys.maxsize))
        episode_s = time.perf_counter() - start
        if traj.infra_error:
            raise CRRError(f"the scripted trajectory hit an infrastructure failure: {traj.infra_error}")
        if len(traj.steps) < steps:
            raise CRRError(f"the scripted trajectory ended after {len(traj.steps)} of its {steps} steps "
                           f"({traj.end_reason})")
        result = {"engine": engine, "task": task.instance_id, "steps": len(traj.steps), "repeats": repeats,
                  "episode_s": episode_s,
                  "snapshot_ms_p50": statistics.median(s.snapshot_ms for s in traj.steps if s.snapshot_ms is not None),
                  "at": {}}
        digest_ms = []
        for t in at:
            restore_ms, ready_ms, replay_ms, exact = [], [], [], True
            for _ in range(repeats):
                t0 = time.perf_counter()
                with fork_at(traj, t) as sandbox:
                    restore_ms.append(1e3 * (time.perf_counter() - t0))
                    sandbox.exec("true")  # ready once a first command has run in it (some engines attach lazily)
                    ready_ms.append(1e3 * (time.perf_counter() - t0))
                    t1 = time.perf_counter()
                    exact &= tree_digest(sandbox) == traj.steps[t].digest
                    digest_ms.append(1e3 * (time.perf_counter() - t1))
                t0 = time.perf_counter()
                with replay_at(traj, t, eng):  # raises if the replay diverged
                    replay_ms.append(1e3 * (time.perf_counter() - t0))
            result["at"][t] = {"restore_ms_p50": statistics.median(restore_ms),
                               "ready_ms_p50": statistics.median(ready_ms),
                               "replay_ms_p50": statistics.median(replay_ms), "restore_exact": exact}
        result["digest_ms_p50"] = statistics.median(digest_ms)
        traj.release()
        return result


def throughput_config(group_size: int = 8, max_turns: int = 4, max_new_tokens: int = 96, temperature: float = 0.6,
                      seed: int = 0, workers: int = 4) -> RolloutConfig:
    """The throughput run's rollout settings, checked (a bad one is a CRRError before any work)."""
    return RolloutConfig(group_size=group_size, seed=seed, workers=workers, episode=EpisodeConfig(
        max_turns=max_turns, temperature=temperature, max_new_tokens=max_new_tokens, snapshots=False))


def throughput_bench(model: str | None = None, group_size: int = 8, max_turns: int = 4, max_new_tokens: int = 96,
                     max_value_chars: int | None = 16, temperature: float = 0.6, seed: int = 0,
                     engine: str = "local", workers: int = 4, threads: int | None = None,
                     prefix_cache: bool = True, engine_opts: dict | None = None) -> dict:
    """One micro task, G trajectories of the policy with a short turn cap: generated tokens per second
    (of generation time) and trajectories per minute (of wall time). `threads` sets torch's intra-op
    threads (on 2 busy cores one thread is several times faster than two spinning against each other);
    `prefix_cache` False re-encodes every turn's whole conversation (the backend without prefix reuse)."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = model or str(default_model_dir())
    model_obj, tokenizer = load_policy(model)
    backend = TransformersBackend(model_obj, tokenizer, max_value_chars=max_value_chars,
                                  **({} if prefix_cache else {"prefix_cache_bytes": 0}))
    config = throughput_config(group_size, max_turns, max_new_tokens, temperature, seed, workers)
    with (tempfile.TemporaryDirectory(prefix="crr-rollout-bench-") as tmp,
          get_engine(engine, **(engine_opts or {})) as eng):
        task = _micro_task(seed, Path(tmp))
        result = rollout([task], backend, eng, tokenizer, config)
    s = result.summary
    return {"model": model, "threads": torch.get_num_threads(), "group_size": group_size, "max_turns": max_turns,
            "max_new_tokens": max_new_tokens, "max_value_chars": max_value_chars, "temperature": temperature,
            "engine": engine,
            "prefix_cache": prefix_cache, "prompt_tokens_reused": backend.prefix_cache.reused_tokens,
            "prompt_tokens_prefilled": backend.prefix_cache.prefilled_tokens if prefix_cache else None,
            **{k: s[k] for k in ("trajectories", "steps", "mean_turns", "generated_tokens", "generation_s", "wall_s",
                                 "generated_tokens_per_s", "trajectories_per_min", "grammar_rejection_rate",
                                 "truncated_calls", "end_reasons")}}
