"""`crr filter-tasks bench`: the determinism filter scored against planted, labelled flakiness.

Micro tasks are generated with `flaky_rate` of them carrying one flaky PASS_TO_PASS test
(crr.tasks.micro: hash seed, test order, unseeded randomness or the clock; the label is
task.metadata["flaky"]), the filter runs on them, and its verdicts are scored against the labels:
recall of flaky tasks (discarded among labelled flaky), false discards (deterministic tasks
discarded), infra errors, and throughput. Generation and filtering share one run directory, so the
tasks, results and score stay together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

from crr.filter.determinism import (COMMAND, DEFAULTS, DISCARDED, INFRA_ERROR, RESULTS, filter_config,
                                    filter_tasks)
from crr.rundir import RunDir
from crr.tasks.micro import generate_micro
from crr.tasks.schema import Task


def filter_bench(n: int, flaky_rate: float, seed: int, engine: str = "local", mode: str | None = None,
                 ray: str | None = None, reruns: int = 3, workers: int = 2, out: Path | str = "results/runs", split: str = "train",
                 on_start: Callable[[int, int], None] | None = None,
                 on_result: Callable[[dict], None] | None = None) -> dict:
    """Generate, filter and score; returns the score (also written to the run dir as bench.json)."""
    settings = {**DEFAULTS, "engine": engine, "mode": mode, "ray": ray, "reruns": reruns, "seed": seed}
    config = filter_config(settings)  # validates before anything is generated
    run = RunDir.create(COMMAND, f"bench-{engine}-n{n}-r{reruns}", root=out,
                        seeds={"micro": seed, "filter": seed})
    settings["tasks"] = str((run.path / "tasks").resolve())
    settings["bench"] = {"n": n, "flaky_rate": flaky_rate, "split": split}
    run.write_text("config.yaml", yaml.safe_dump(settings, sort_keys=False))
    tasks = generate_micro(run.path / "tasks", n=n, seed=seed, split=split, flaky_rate=flaky_rate)
    summary = filter_tasks(tasks, run, config, workers=workers, on_start=on_start, on_result=on_result)
    result = {"engine": engine, "mode": mode, "n": n, "flaky_rate": flaky_rate, "seed": seed,
              "reruns": reruns, "workers": workers, **score(tasks, run.records(RESULTS)),
              "tasks_per_min": summary.tasks_per_min, "discard_rate": summary.discard_rate,
              "run_dir": str(run.path)}
    run.write_json("bench.json", result)
    return result


def score(tasks: list[Task], records: list[dict]) -> dict:
    """Verdicts against the labels in task.metadata["flaky"] ({"kind", "test"} or None)."""
    latest = {r["instance_id"]: r for r in records}
    per_kind: dict[str, dict] = {}
    caught_by: Counter[str] = Counter()
    false_discards, infra = [], []
    flaky_evaluated = caught = named = deterministic = 0
    for task in tasks:
        record = latest.get(task.instance_id)
        if record is None:
            continue
        if record["verdict"] == INFRA_ERROR:
            infra.append(task.instance_id)
            continue
        label = task.metadata.get("flaky")
        discarded = record["verdict"] == DISCARDED
        if not label:
            deterministic += 1
            if discarded:
                false_discards.append({"instance_id": task.instance_id, "reason": record["reason"],
                                       "tests": record["tests"]})
            continue
        kind = per_kind.setdefault(label["kind"], {"tasks": 0, "discarded": 0, "missed": []})
        kind["tasks"] += 1
        flaky_evaluated += 1
        if discarded:
            kind["discarded"] += 1
            caught += 1
            caught_by[record["reason"]] += 1
            named += label["test"] in record["tests"]
        else:
            kind["missed"].append(task.instance_id)
    for kind in per_kind.values():
        kind["recall"] = kind["discarded"] / kind["tasks"]
    return {"flaky_tasks": flaky_evaluated, "flaky_discarded": caught,
            "recall": caught / flaky_evaluated if flaky_evaluated else None,
            "discards_naming_the_planted_test": named, "caught_by": dict(sorted(caught_by.items())),
            "per_kind": dict(sorted(per_kind.items())),
            "deterministic_tasks": deterministic,
            "false_discards": len(false_discards), "false_discard_details": false_discards,
            "infra_errors": len(infra), "infra_error_ids": infra}
