"""Benchmark for the report (not a timed test): does RL from the shipped warm start learn at CPU scale?

    .venv/bin/python scripts/learn_bench.py --method grpo --updates 20 --seeds 11 23 47 --eval-n 32 \
        [--out results/learn-bench] [key=value overrides...]
    .venv/bin/python scripts/learn_bench.py --method grpo --eval-n 64 --from-comparison results/reference/cpu-main \
        [--arm grpo-equal-wall-clock]

With --from-comparison, the arm's finished runs of a `crr experiment run` output directory are summarised
(their final greedy evaluation on the same tasks read from its evals/) instead of new runs being trained.
Besides the quarters, each task the run trained on more than once is compared with itself: the mean reward
of its group at its first visit and at its last (the band repeats tasks, so this pairs the same task before
and after the updates in between).

For each seed, `crr train` (CPU preset) from the shipped default, then greedy pass@1 of the trained policy on
the first N held-out nano-test tasks; the starting policy is evaluated once (greedy decoding does not depend
on the seed). Prints the training reward of the first and last quarter of updates and the held-out pass@1
before and after, per seed and as mean ± std over seeds, and writes the same as JSON into OUT/summary.json.
Every run directory stays in OUT (resumable: a finished seed is read back, not re-run).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from crr.eval.evaluate import EvalConfig, benchmark, evaluate, resolve_policy, start_eval
from crr.report.runs import load_runs
from crr.rundir import RunDir
from crr.train.config import load_config, parse_overrides
from crr.train.trainer import resolve_model, start_run, train


def held_out(policy, cfg, n: int, done: Path, tasks: str) -> float:
    """Greedy pass@1 of `policy` on the first n tasks; an eval run beside `done`, which records the result."""
    if done.is_file():
        return json.loads(done.read_text())["pass_at_1"]
    label, source, adapter = benchmark(tasks)
    config = EvalConfig.make(label, source, adapter, policy, n_tasks=n, max_turns=cfg.max_turns,
                             max_new_tokens=cfg.max_new_tokens, agent_format=cfg.agent_format)
    run = start_eval(config, done.parent)
    summary = evaluate(config, run)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps({"pass_at_1": summary["pass_at_1"], "run": run.path.name}) + "\n")
    return summary["pass_at_1"]


def quarter_means(run: RunDir) -> tuple[float, float, list[float]]:
    rewards = [r["reward_mean"] for r in run.records("metrics.jsonl")
               if r.get("event") == "iteration" and r.get("reward_mean") is not None]
    q = max(1, len(rewards) // 4)
    return sum(rewards[:q]) / q, sum(rewards[-q:]) / q, rewards


def revisits(run: RunDir) -> tuple[float | None, float | None, int]:
    """(mean group reward at the first visit, at the last visit, tasks) over tasks visited more than once."""
    seen: dict[str, list[float]] = {}
    for r in run.records("metrics.jsonl"):
        for task, rewards in (r.get("group_rewards") or {}).items() if r.get("event") == "iteration" else ():
            scored = [x for x in rewards if x is not None]
            if scored:
                seen.setdefault(task, []).append(sum(scored) / len(scored))
    twice = [v for v in seen.values() if len(v) > 1]
    if not twice:
        return None, None, 0
    return sum(v[0] for v in twice) / len(twice), sum(v[-1] for v in twice) / len(twice), len(twice)


def compared(out: Path, arm: str, seed: int, eval_tasks: str) -> tuple[RunDir, float]:
    """The finished run of `arm` and `seed` in a comparison directory and its final greedy pass@1."""
    runs = load_runs([out / "runs" / arm, out / "evals" / arm])
    done = sorted((r for r in runs.train if r.seed == seed and r.complete), key=lambda r: r.path.name)
    if not done:
        raise SystemExit(f"no finished {arm} run of seed {seed} under {out / 'runs' / arm}")
    greedy = runs.evals_of(done[-1], eval_tasks, samples=1)
    if greedy is None:
        raise SystemExit(f"no finished greedy {eval_tasks} evaluation of {done[-1].path}")
    return RunDir.open(done[-1].path), greedy.summary["pass_at_1"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="grpo")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[11, 23, 47])
    ap.add_argument("--eval-n", type=int, default=32)
    ap.add_argument("--eval-tasks", default="nano-test")
    ap.add_argument("--out", type=Path, default=Path("results/learn-bench"))
    ap.add_argument("--from-comparison", type=Path, default=None,
                    help="summarise this comparison directory's runs of --arm instead of training")
    ap.add_argument("--arm", default=None, help="with --from-comparison: the arm (default: --method)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    base_cfg = load_config(None, {**parse_overrides(args.overrides), "method": args.method})
    if base_cfg.agent_format is None:
        from crr.policy.model import agent_record
        base_cfg.agent_format = agent_record(resolve_model(base_cfg)).get("agent_format", "paper")
    before = held_out(resolve_policy(resolve_model(base_cfg)), base_cfg, args.eval_n,
                      args.out / "before" / "done.json", args.eval_tasks)
    for seed in args.seeds:
        if args.from_comparison is not None:
            run, after = compared(args.from_comparison, args.arm or args.method, seed, args.eval_tasks)
        else:
            seed_dir = args.out / f"{args.method}-seed{seed}"
            finished = [p for p in seed_dir.glob("*-train-*") if (p / "summary.json").is_file()]
            if finished:
                run = RunDir.open(finished[0])
            else:
                cfg = load_config(None, {**parse_overrides(args.overrides), "method": args.method, "seed": seed,
                                         "max_steps": args.updates, "output_dir": str(seed_dir)})
                run = start_run(cfg, seed_dir)
                train(cfg, run)
            cfg = load_config(run.path / "config.yaml")
            after = held_out(resolve_policy(run=run.path), cfg, args.eval_n, seed_dir / "eval" / "done.json",
                             args.eval_tasks)
        first, last, rewards = quarter_means(run)
        visit_first, visit_last, revisited = revisits(run)
        rows.append({"seed": seed, "updates": len(rewards), "reward_first_quarter": first,
                     "reward_last_quarter": last, "rewards": rewards, "revisited_tasks": revisited,
                     "revisit_first": visit_first, "revisit_last": visit_last,
                     "pass_at_1_before": before, "pass_at_1_after": after})
        again = "" if not revisited else (f"; the {revisited} tasks trained on more than once: {visit_first:.2f} at "
                                          f"the first visit -> {visit_last:.2f} at the last")
        print(f"seed {seed}: training reward {first:.2f} -> {last:.2f} (first/last quarter of {len(rewards)} updates)"
              f"{again}; held-out pass@1 {before:.1%} -> {after:.1%}", flush=True)

    def ms(key: str) -> str:
        vals = [r[key] for r in rows]
        return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals) if len(vals) > 1 else 0.0:.3f}"

    revisit = (f"; revisited tasks {ms('revisit_first')} -> {ms('revisit_last')}"
               if all(r["revisited_tasks"] for r in rows) else "")
    print(f"{args.arm or args.method}, {rows[0]['updates']} updates, seeds {args.seeds}: training reward "
          f"{ms('reward_first_quarter')} -> {ms('reward_last_quarter')}{revisit}; held-out pass@1 {before:.3f} -> "
          f"{ms('pass_at_1_after')}")
    (args.out / "summary.json").write_text(json.dumps({"method": args.method, "arm": args.arm,
                                                       "updates": rows[0]["updates"], "eval_tasks": args.eval_tasks,
                                                       "eval_n": args.eval_n, "seeds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
