"""Benchmark for the report (not a timed test): the CRR proposal q_{not a} drawn by the transformers backend
(one steered row per try that misses the realised tokenization; crr.policy.backend) against the rejection
sampler that defines it (vLLM's, and this backend's before), on the same states, alternating, in one run.

    .venv/bin/python scripts/proposal_bench.py [--config experiments/multi-crr.yaml] [--n 4] [--repeats 3] [--eta H]

Plays G on-policy trajectories on each of the preset's first n tasks (its model, turn cap, token budget and
rollout temperature, seed 0), takes the complete calls that pass the preset's entropy gate (H_t > eta; `--eta`)
as selected steps, and draws their proposals at the preset's T_cf in batches of `--batch` (about a training
update's forks), both ways: seconds, decoded rows and decoding passes, the skip rates (all tries a_t: the same in
distribution, so they agree up to sampling noise) and the ratio of seconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from crr.agent.tools import ToolCallError, parse_tool_call
from crr.policy.backend import rejection_sample
from crr.rollout import start_rollout
from crr.train.config import load_config
from crr.train.trainer import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="experiments/multi-crr.yaml")
    ap.add_argument("--n", type=int, default=4, help="tasks (each played G times)")
    ap.add_argument("--batch", type=int, default=12, help="proposals per generate call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eta", type=float, default=None, help="entropy gate (default: the preset's; 0: every step)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    eta = cfg.eta if args.eta is None else args.eta
    play = start_rollout(resolve_model(cfg), cfg.tasks, args.n, Path(tempfile.mkdtemp(prefix="crr-proposal-bench-")),
                         group_size=cfg.num_generations, temperature=cfg.rollout_temperature,
                         max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens)
    trajectories = play.execute().trajectories
    backend, tokenizer = play.backend, play.tokenizer
    states = [(traj.conversation(tokenizer, t).token_ids(), step.action, step.action_ids)
              for traj in trajectories for t, step in enumerate(traj.steps)
              if _canonical(step.action) and step.entropy > eta]
    batches = [states[i:i + args.batch] for i in range(0, len(states), args.batch)]
    passes: list[int] = []
    sample_rows = backend._sample
    backend._sample = lambda prompts, *a, **kw: passes.append(len(prompts)) or sample_rows(prompts, *a, **kw)

    def steered(batch, seed):
        return backend.generate([p for p, _, _ in batch], temperature=cfg.cf_temperature, seed=seed,
                                max_new_tokens=cfg.max_new_tokens, exclude=[a for _, a, _ in batch],
                                exclude_ids=[ids for _, _, ids in batch])

    def rejection(batch, seed):
        return rejection_sample(backend, [p for p, _, _ in batch], [ids for _, _, ids in batch],
                                [_canonical(a) for _, a, _ in batch], cfg.cf_temperature,
                                torch.Generator().manual_seed(seed), cfg.max_new_tokens)

    result = {name: {"s": 0.0, "rows": 0, "passes": 0, "skips": 0, "proposals": 0}
              for name in ("steered", "rejection")}
    for repeat in range(args.repeats):
        for b, batch in enumerate(batches):
            for name, draw in (("steered", steered), ("rejection", rejection)):
                del passes[:]
                start = time.perf_counter()
                samples = draw(batch, 1000 * repeat + b)
                r = result[name]
                r["s"] += time.perf_counter() - start
                r["rows"], r["passes"] = r["rows"] + sum(passes), r["passes"] + len(passes)
                r["skips"] += sum(s.exclusion_failed for s in samples)
                r["proposals"] += len(samples)
    for r in result.values():
        r["s_per_proposal"] = r["s"] / r["proposals"]
        r["rows_per_proposal"] = r["rows"] / r["proposals"]
        r["skip_rate"] = r["skips"] / r["proposals"]
    print(json.dumps({"config": args.config, "eta": eta, "trajectories": len(trajectories), "states": len(states),
                      "batches": len(batches), "repeats": args.repeats, **result,
                      "steered_over_rejection_s": result["steered"]["s"] / result["rejection"]["s"]}, indent=2))


def _canonical(text: str) -> str | None:
    try:
        return parse_tool_call(text).canonical()
    except ToolCallError:   # a call cut off by the token budget: not a step a proposal replaces here
        return None


if __name__ == "__main__":
    main()
