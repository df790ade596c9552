"""The learnable band: training tasks that the starting policy sometimes solves.

GRPO's group advantage R - mean(R of the G siblings) is 0 for every sibling of a task whose G samples all
fail or all pass, and so is CRR's contrast when the realised and the counterfactual branches agree; a task
far outside the policy's reach contributes rollouts and no gradient. RL pipelines for reasoning and SWE
agents therefore keep the prompts whose solve rate under the starting policy lies strictly between 0 and 1
(offline pass-rate filtering; DAPO's dynamic sampling does the same online). Here the solve rate is read off
a sampled `crr eval` of the starting policy on a candidate pool:

    crr eval tasks POOL --samples 4 --temperature 0.6 ...      # the starting policy, n samples per task
    crr tasks band EVAL_RUN --low 0.25 --high 0.75 --out DIR   # tasks with low <= c/n <= high

The selected rows are written with their repository bundles into DIR (tasks.jsonl, repos/, band.json: the
source evaluation, each task's (n, c) and the band), so the set is self-contained and any command that takes
`--tasks` or `tasks=` trains on it. Held-out evaluation stays on the unfiltered test split.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from crr.errors import CRRError
from crr.eval.evaluate import RESULTS
from crr.eval.passk import instance_counts
from crr.rundir import RunDir, atomic_write_text, relative_to_cwd
from crr.tasks.loaders import load_tasks, write_tasks
from crr.tasks.schema import Task

BAND_FILE = "band.json"


def select_band(tasks: list[Task], counts: dict[str, tuple[int, int]], low: float, high: float,
                min_samples: int = 1) -> list[Task]:
    """The tasks (in their order) with at least `min_samples` scored samples and low <= c / n <= high."""
    if not 0.0 <= low <= high <= 1.0:
        raise CRRError(f"the band needs 0 <= low <= high <= 1, got low={low}, high={high}")
    return [t for t in tasks if t.instance_id in counts and counts[t.instance_id][0] >= min_samples
            and low <= counts[t.instance_id][1] / counts[t.instance_id][0] <= high]


def band_from_eval(eval_dir: Path | str, out: Path | str, low: float, high: float) -> dict:
    """Select the band from a sampled evaluation run and write it, bundles included, into `out`."""
    run = RunDir.open(eval_dir)
    config = run.config
    records = run.records(RESULTS)
    if not records:
        raise CRRError(f"{run.path} has no {RESULTS}: evaluate the starting policy with --samples n first")
    samples = config.get("samples", 1)
    if samples < 2:
        raise CRRError(f"{run.path} is a greedy evaluation (1 sample per task): a solve rate needs "
                       "--samples n (e.g. 4 or 8) at the rollout temperature")
    counts = instance_counts(records)
    tasks = load_tasks(config["tasks"])
    chosen = select_band(tasks, counts, low, high, min_samples=samples)
    if not chosen:
        raise CRRError(f"no task of {run.path.name} has a solve rate in [{low}, {high}]; widen the band or "
                       "evaluate a larger pool")
    out = Path(out)
    if (out / "tasks.jsonl").exists():
        raise CRRError(f"{out} already holds a task set; choose a new --out")
    (out / "repos").mkdir(parents=True, exist_ok=True)
    copied = []
    for task in chosen:
        if task.repo_src and Path(task.repo_src).is_file():  # a git bundle: copy it beside the rows
            target = out / "repos" / Path(task.repo_src).name
            shutil.copyfile(task.repo_src, target)
            task = replace(task, repo_src=str(target.resolve()))
        copied.append(task)
    write_tasks(copied, out / "tasks.jsonl")
    rates = [c / n for n, c in (counts[t.instance_id] for t in chosen)]
    model = config.get("model")
    if model is not None:  # committed sets carry no machine's paths
        model = relative_to_cwd(model) or Path(model).name
    summary = {"source_eval": run.path.name, "model": model, "samples": samples,
               "temperature": config.get("temperature"), "low": low, "high": high,
               "pool": len(tasks), "evaluated": len(counts), "selected": len(chosen),
               "mean_solve_rate": sum(rates) / len(rates),
               "pool_solve_rate": sum(c / n for n, c in counts.values()) / len(counts),
               "solve_rates": {t.instance_id: list(counts[t.instance_id]) for t in chosen}}
    atomic_write_text(out / BAND_FILE, json.dumps(summary, indent=1) + "\n")
    return summary

