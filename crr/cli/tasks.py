"""Task sets: `crr tasks micro|bench|synth|show|sets|band`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import (
    ENGINES_HELP,
    _resume_with,
    _same_command,
    console,
    emit_json,
    engine_opt_option,
    engine_option,
    err_console,
    friendly,
    json_option,
    long_command,
    out_option,
    progress_bar,
    ray_option,
    seed_option,
)
from crr.errors import CRRError

tasks_app = typer.Typer(help="Task sets: generate the embedded micro set; validate and inspect task files "
                             "and datasets.", no_args_is_help=True)


@tasks_app.command("micro")
@friendly
def tasks_micro(
    n: int = typer.Option(32, "--n", help="Number of tasks."),
    seed: int = seed_option(help="Same seed, same tasks, byte for byte."),
    split: str = typer.Option("train", "--split", help="train or test (disjoint templates; for nano and multi, "
                              "disjoint vocabularies), or val (nano and multi: the test vocabulary, its own "
                              "instances)."),
    tier: str = typer.Option("default", "--tier", help="default (templates, fillers, decoys: 3-20 modules), nano "
                             "(1-3 short modules with procedural names: the learnable CPU tier) or multi (nano "
                             "packages with 1-3 bugs, symptom-only issues and look-alike modules)."),
    bugs: str | None = typer.Option(None, "--bugs", help="multi: bug counts the set cycles through [default: 1,2,3]."),
    issue: str | None = typer.Option(None, "--issue", help="multi: issue styles the set cycles through, among "
                                     "named, symptom, test_id [default: all three]."),
    distractors: int | None = typer.Option(None, "--distractors", help="multi: look-alike modules per task, at most "
                                           "[default: 2]."),
    flaky_rate: float = typer.Option(0.0, "--flaky-rate", help="Fraction of tasks with one labelled flaky test."),
    workers: int = typer.Option(1, "--workers", help="Processes generating tasks (same rows for any number)."),
    warm: bool = typer.Option(True, "--warm-pytest/--fresh-pytest", help="Measure tests in forks of a warm pytest "
                              "worker (default) or a fresh interpreter per run: same rows, compare the rates."),
    first: int = typer.Option(0, "--first", help="Index of the first task: a large set in chunks (chunk rows equal "
                              "the whole set's)."),
    out: Path = out_option(..., "New (or empty) directory for tasks.jsonl and repos/."),
) -> None:
    """Generate micro tasks: small Python packages with one injected bug each, an issue, a gold
    patch and held-out tests whose FAIL_TO_PASS/PASS_TO_PASS are measured by running pytest."""
    from collections import Counter

    from rich.table import Table

    from crr.tasks.micro import generate_micro
    from crr.tasks.multi import Knobs

    knobs = None
    if (bugs, issue, distractors) != (None, None, None):
        default = Knobs()
        knobs = Knobs.parse(bugs or ",".join(map(str, default.bugs)), issue or ",".join(default.issue),
                            default.distractors if distractors is None else distractors)
    with progress_bar("{task.description}") as bar:
        job = bar.add_task(f"{tier} {split} (seed {seed})", total=n)
        start = time.perf_counter()
        tasks = generate_micro(out, n=n, seed=seed, split=split, flaky_rate=flaky_rate, tier=tier, workers=workers,
                               first=first, warm=warm, progress=lambda _: bar.advance(job), knobs=knobs)
        elapsed = time.perf_counter() - start
    tiers = ("easy", "medium", "hard")
    counts = Counter((t.metadata["bug_family"], t.metadata["difficulty"]) for t in tasks)
    per_tier = Counter(t.metadata["difficulty"] for t in tasks)
    table = Table(title=f"{len(tasks)} micro tasks ({split}, seed {seed})")
    table.add_column("bug family")
    for col in (*tiers, "total"):
        table.add_column(col, justify="right")
    for family in sorted({f for f, _ in counts}):
        row = [counts[(family, tier)] for tier in tiers]
        table.add_row(family, *map(str, row), str(sum(row)))
    table.add_row("[bold]total[/]", *(str(per_tier[t]) for t in tiers), f"[bold]{len(tasks)}[/]")
    console.print(table)
    if tier == "multi":
        shares = Counter((t.metadata["n_bugs"], t.metadata["issue_style"]) for t in tasks)
        console.print("bugs x issue style: " + ", ".join(f"{b} {s}: {c}" for (b, s), c in sorted(shares.items())),
                      highlight=False)
    flaky = sum(1 for t in tasks if t.metadata.get("flaky"))
    console.print(f"{flaky} with a labelled flaky test; {len(tasks) / elapsed:.2f} tasks/s with {workers} "
                  f"worker(s); wrote {Path(out) / 'tasks.jsonl'}", highlight=False)


@tasks_app.command("bench")
@friendly
def tasks_bench(
    n: int = typer.Option(200, "--n", help="Tasks to generate (into a throw-away directory)."),
    seed: int = seed_option(help="Generator seed."),
    split: str = typer.Option("train", "--split", help="train, val (nano, multi) or test."),
    tier: str = typer.Option("nano", "--tier", help="default, nano or multi."),
    workers: int = typer.Option(1, "--workers", help="Generating processes."),
    warm: bool = typer.Option(True, "--warm-pytest/--fresh-pytest", help="Warm pytest worker or a fresh "
                              "interpreter per pytest run."),
    json_out: bool = json_option(),
) -> None:
    """Time task generation (tasks/s) and describe what it made: bug families, file sizes, issue length."""
    from rich.table import Table

    from crr.bench.tasks import bench_micro

    with err_console.status(f"generating {n} {tier} {split} tasks ({workers} worker(s), "
                            f"{'warm' if warm else 'fresh'} pytest)"):
        result = bench_micro(n, seed=seed, split=split, tier=tier, workers=workers, warm=warm)
    if json_out:
        console.print_json(json.dumps(result))
        return
    console.print(f"{result['tasks_per_s']:.2f} tasks/s: {n} {tier} {split} tasks in {result['seconds']:.1f}s with "
                  f"{workers} worker(s), {'warm' if warm else 'fresh'} pytest", highlight=False)
    families = Table(title="bug families")
    families.add_column("family")
    families.add_column("tasks", justify="right")
    for family, count in result["families"].items():
        families.add_row(family, str(count))
    console.print(families)
    if "n_bugs" in result:
        console.print("bugs per task: " + ", ".join(f"{k}: {v}" for k, v in result["n_bugs"].items()), highlight=False)
    files = Table(title=f"files at base_commit (first {min(n, 50)} tasks); issue {result['issue_chars']:.0f} chars")
    for col in ("kind", "per task", "lines", "chars", "tokens"):
        files.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in result["files"].items():
        files.add_row(kind, f"{row['per_task']:.2f}", f"{row['mean_lines']:.1f}", f"{row['mean_chars']:.0f}",
                      f"{row['mean_tokens']:.0f}")
    console.print(files)


@tasks_app.command("synth")
@long_command
def tasks_synth(
    package: list[str] = typer.Option([], "--package", help="NAME==VERSION of a PyPI package whose sdist "
                                      "carries its tests (repeatable)."),
    curated: bool = typer.Option(False, "--curated", help="Every package of crr/tasks/packages.yaml."),
    n: int = typer.Option(2, "--n", help="Tasks per package (at most)."),
    out: Path = out_option(..., "New (or empty) directory for tasks.jsonl; an interrupted run's directory "
                           "resumes."),
    seed: int = seed_option(help="Seed of the order bugs are tried in and of the issue texts."),
    requires: list[str] = typer.Option([], "--requires", help="Extra test requirement for --package, e.g. "
                                       "hypothesis==6.100.0 (repeatable)."),
    engine: str = engine_option(help=f"Sandbox engine for the test runs: {ENGINES_HELP}."),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    max_candidates: int = typer.Option(30, "--max-candidates", help="Candidate bugs run per package."),
) -> None:
    """Tasks from real packages: the sdist becomes a git repository, its own test suite runs in a
    sandbox, SWE-smith's procedural modifiers inject bugs, and bugs that break passing tests become
    SWE-bench rows (F2P/P2P measured, issue text from the failing test)."""
    from rich.table import Table

    from crr.sandbox import engine_spec, parse_options
    from crr.tasks.synth import curated as curated_packages
    from crr.tasks.synth import parse_package, synthesise

    if requires and not package:
        raise CRRError("--requires is for --package only (a curated package's requirements are in "
                       "crr/tasks/packages.yaml)")
    opts = engine_spec(engine, parse_options(engine_opt or []), ray=ray).options
    specs = [parse_package(p, tuple(requires)) for p in package] + (curated_packages() if curated else [])
    _resume_with(_same_command())  # its --out resumes
    with progress_bar("{task.description}", "{task.fields[note]}") as bar:
        jobs: dict[str, int] = {}

        def progress(state) -> None:
            if state.package not in jobs:
                jobs[state.package] = bar.add_task(state.package, total=n, note="")
            bar.update(jobs[state.package], completed=state.tasks,
                       note=f"{state.candidates} candidate bugs tried")

        tasks = synthesise(specs, out, n=n, seed=seed, engine=engine, engine_opts=opts,
                           max_candidates=max_candidates, progress=progress)
    table = Table(title=f"{len(tasks)} tasks from {len(specs)} package(s)")
    for col in ("instance_id", "bug", "#F2P", "#P2P"):
        table.add_column(col, justify="right" if col.startswith("#") else "left")
    for t in tasks:
        table.add_row(t.instance_id, f"{t.metadata['bug_strategy']} in {t.metadata['buggy_entity']}",
                      str(len(t.FAIL_TO_PASS)), str(len(t.PASS_TO_PASS)))
    console.print(table)
    console.print(f"wrote {Path(out) / 'tasks.jsonl'}", highlight=False)


@tasks_app.command("show")
@friendly
def tasks_show(
    source: str = typer.Argument(..., help="A named set (`crr tasks sets`), a JSONL file, a directory with "
                                           "tasks.jsonl, a dataset name, a save_to_disk directory or a .parquet file."),
    split: str | None = typer.Option(None, "--split", help="Dataset split (datasets only)."),
    adapter: str | None = typer.Option(None, "--adapter", help="Dataset adapter for local copies: swe-bench, "
                                       "swe-gym, swe-rebench, swe-bench-live, generic."),
    limit: int | None = typer.Option(None, "--limit", min=0, help="Show at most this many tasks."),
    as_json: bool = json_option("the validated rows"),
    out: Path | None = out_option(None, "Also write the tasks shown as a task file (JSONL) here, which every "
                                        "--tasks option takes: how a local dataset copy read with --adapter is "
                                        "used by the other commands."),
) -> None:
    """Validate a task set and list its tasks (bad rows exit 2 with FILE:LINE and the field)."""
    from rich.table import Table

    from crr.tasks.loaders import load_tasks, write_tasks

    if out is not None and out.exists():
        raise CRRError(f"{out} already exists; pass a new file")
    tasks = load_tasks(source, split, adapter=adapter)
    shown = tasks if limit is None else tasks[:limit]
    if out is not None:
        write_tasks(shown, out)
        err_console.print(f"wrote {len(shown)} tasks to {out}", highlight=False)
    if as_json:
        emit_json([t.to_row() for t in shown])
        return
    table = Table(title=f"{len(tasks)} tasks from {source}"
                        + (f" (first {len(shown)})" if len(shown) < len(tasks) else ""))
    table.add_column("instance_id")
    table.add_column("repo")
    table.add_column("#F2P", justify="right")
    table.add_column("#P2P", justify="right")
    table.add_column("difficulty")
    for t in shown:
        difficulty = t.metadata.get("difficulty") or t.extra.get("difficulty") or ""
        table.add_row(Text(t.instance_id), Text(t.repo), str(len(t.FAIL_TO_PASS)), str(len(t.PASS_TO_PASS)),
                      Text(str(difficulty)))
    console.print(table)


@tasks_app.command("sets")
@friendly
def tasks_sets(as_json: bool = json_option("name, what and hub dataset of each set")) -> None:
    """The named task sets (crr.tasks.loaders.TASK_SETS): what `crr tasks show`, `crr eval NAME` and a
    config's tasks/eval key take by name."""
    from rich.table import Table

    from crr.tasks.loaders import TASK_SETS

    if as_json:
        emit_json([{"name": s.name, "what": s.what, "dataset": s.dataset} for s in TASK_SETS.values()])
        return
    table = Table(title=f"{len(TASK_SETS)} named task sets")
    table.add_column("name")
    table.add_column("what")
    for s in TASK_SETS.values():
        table.add_row(Text(s.name), Text(s.what))
    console.print(table)


@tasks_app.command("band")
@friendly
def tasks_band(
    eval_run: Path = typer.Argument(..., help="A sampled `crr eval` run of the starting policy on a candidate pool "
                                    "(--samples n at the rollout temperature)."),
    low: float = typer.Option(0.25, "--low", help="Lowest solve rate c/n kept."),
    high: float = typer.Option(0.75, "--high", help="Highest solve rate c/n kept."),
    out: Path = out_option(..., "New directory for tasks.jsonl, repos/ and band.json."),
) -> None:
    """The learnable band: the pool's tasks whose sampled solve rate under the starting policy lies in
    [--low, --high], written with their repositories as a self-contained task set for training."""
    from crr.eval.band import band_from_eval

    s = band_from_eval(eval_run, out, low, high)
    console.print(f"{s['selected']} of {s['evaluated']} tasks with a solve rate in [{low:g}, {high:g}] "
                  f"({s['samples']} samples at T={s['temperature']}): mean solve rate {s['mean_solve_rate']:.1%} "
                  f"(pool {s['pool_solve_rate']:.1%}); wrote {out / 'tasks.jsonl'}", highlight=False)
