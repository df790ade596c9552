"""`crr filter-tasks bench`: the determinism filter scored against planted, labelled flakiness.

Micro tasks are generated with `flaky_rate` of them carrying one flaky PASS_TO_PASS test
(crr.tasks.micro: hash seed, test order, unseeded randomness or the clock; the label is
task.metadata["flaky"]), the filter runs on them, and its verdicts are scored against the labels:
recall of flaky tasks (discarded among labelled flaky), false discards (deterministic tasks
discarded), infra errors, and throughput. Generation and filtering share one run directory, so the
tasks, results and score stay together.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

from crr.errors import CRRError
from crr.filter.determinism import (COMMAND, DEFAULTS, DISCARDED, INFRA_ERROR, RESULTS, filter_config,
                                    filter_tasks)
from crr.rundir import RunDir
from crr.tasks.micro import check_micro_args, generate_micro
from crr.tasks.schema import Task


def check_bench(n: int, flaky_rate: float, split: str, workers: int) -> None:
    """The benchmark's own settings (the filter's are filter_config's): a CRRError before anything is made."""
    check_micro_args(n, split, flaky_rate)
    if workers < 1:
        raise CRRError(f"--workers must be at least 1, got {workers}")


def filter_bench(n: int, flaky_rate: float, seed: int, engine: str = "local", mode: str | None = None,
                 ray: str | None = None, engine_options: dict | None = None, reruns: int = 3, workers: int = 2,
                 out: Path | str = "results/runs", split: str = "train",
                 on_start: Callable[[int, dict[str, int]], None] | None = None,
                 on_result: Callable[[dict], None] | None = None) -> dict:
    """Generate, filter and score; returns the score (also written to the run dir as bench.json)."""
    settings = {**DEFAULTS, "engine": engine, "engine_options": engine_options, "mode": mode, "ray": ray,
                "reruns": reruns, "seed": seed}
    config = filter_config(settings)  # validates before anything is generated
    check_bench(n, flaky_rate, split, workers)
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


def ray_filter_bench(n: int = 8, tasks: str = "nano-band", slots: int = 2, node_counts: tuple[int, ...] = (1, 2),
                     reruns: int = 3, out: Path | str | None = None) -> dict:
    """Filter throughput on the local engine and on `ray:local` over throwaway clusters of 1, 2, ...
    raylets on this machine (crr.bench.fork.local_cluster), in one run, on the first `n` tasks of `tasks`.

    Every configuration has `slots` sandbox slots in all (a cluster of k raylets: slots / k CPUs and
    sandbox slots each) and runs `slots` workers, so the rows differ only in where the sandboxes run; on
    one machine more raylets add no cores, and a ray row's extra wall time over the local one, per task,
    is Ray's scheduling overhead (driver -> sandbox host actor), all in (`overhead_ms_per_task`) and less
    the one-off start of the sandbox hosts (`host_start_s`, timed on the same cluster just before:
    `overhead_ms_per_task_after_start`). The tasks' base checkouts are made before anything is timed. The
    verdicts must agree across the rows (`same_verdicts`). Runs go to `out` (None: a temporary directory,
    removed). Needs the ray extra.
    """
    import tempfile

    from crr.bench.fork import local_cluster
    from crr.sandbox import get_engine
    from crr.sandbox.checkout import base_checkout
    from crr.tasks.loaders import load_tasks

    if n < 1 or slots < 1 or not node_counts or any(k < 1 or slots % k for k in node_counts):
        raise CRRError(f"the filter benchmark needs n >= 1 and node counts that divide slots={slots}")
    chosen = load_tasks(tasks)[:n]
    for task in chosen:
        base_checkout(task)   # cached: no row pays for the clones
    rows, verdicts = [], []
    with tempfile.TemporaryDirectory(prefix="crr-ray-filter-bench-") as tmp:
        root = Path(out) if out is not None else Path(tmp)
        for nodes in (0, *node_counts):   # 0: the local engine, no Ray
            engine = "ray:local" if nodes else "local"
            settings = {**DEFAULTS, "tasks": tasks, "limit": n, "engine": engine, "reruns": reruns}
            with (local_cluster(nodes, cpus=slots // nodes, slots=slots // nodes) if nodes
                  else contextlib.nullcontext()) as address:
                settings["ray"] = address
                start_s = None
                if nodes:   # the hosts' start alone: an engine made and closed on this cluster
                    t0 = time.perf_counter()
                    get_engine(engine, address=address).close()
                    start_s = time.perf_counter() - t0
                run = RunDir.create(COMMAND, f"ray-bench-{engine.replace(':', '-')}-{nodes}nodes", root=root,
                                    config=settings, seeds={"filter": settings["seed"]})
                t0 = time.perf_counter()
                summary = filter_tasks(chosen, run, filter_config(settings), workers=slots)
                wall = time.perf_counter() - t0
            verdicts.append({r["instance_id"]: r["verdict"] for r in run.records(RESULTS)})
            rows.append({"engine": engine, "nodes": nodes, "workers": slots, "wall_s": round(wall, 3),
                         "tasks_per_s": round(len(chosen) / wall, 4), "admitted": summary.admitted,
                         "infra_errors": summary.infra_errors, "host_start_s": start_s and round(start_s, 3)})
    local = rows[0]
    for row in rows[1:]:
        row["overhead_ms_per_task"] = round(1e3 * (row["wall_s"] - local["wall_s"]) / len(chosen), 1)
        row["overhead_ms_per_task_after_start"] = round(
            1e3 * (row["wall_s"] - row["host_start_s"] - local["wall_s"]) / len(chosen), 1)
    return {"tasks": tasks, "n": len(chosen), "reruns": reruns, "slots": slots, "rows": rows,
            "same_verdicts": all(v == verdicts[0] for v in verdicts)}
