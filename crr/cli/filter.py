"""`crr filter-tasks` (the three-rerun determinism filter) and `crr filter-tasks bench`."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import (ENGINE_DEFAULT_LOCAL_HELP, _resume_with, console, emit_json, engine_opt_option,
                            engine_option, engine_settings, err_console, friendly, json_option, long_command,
                            mode_option, out_option, progress_bar, ray_option, seed_option, tasks_option)

filter_app = typer.Typer(help="The three-rerun determinism filter: admit only tasks whose held-out tests "
                              "give the same outcomes in fresh, differently seeded sandboxes.")


def _filter_progress():
    """A Rich progress bar and the (on_start, on_result) callbacks that drive it."""
    from rich.progress import ProgressColumn

    class TasksPerMinute(ProgressColumn):
        def render(self, task):
            return Text(f"{task.speed * 60:.1f} tasks/min" if task.speed else "", style="progress.data.speed")

    progress = progress_bar("filter", "{task.fields[admitted]} admitted, {task.fields[discarded]} discarded, "
                            "{task.fields[infra_error]} infra", TasksPerMinute())
    ids: list = []

    def on_start(total: int, verdicts: dict[str, int]) -> None:   # a resumed run's verdicts so far
        ids.append(progress.add_task("filter", total=total, completed=sum(verdicts.values()), infra_error=0,
                                     admitted=verdicts.get("admitted", 0), discarded=verdicts.get("discarded", 0)))

    def on_result(record: dict) -> None:
        verdict = record["verdict"]
        progress.update(ids[0], advance=1, **{verdict: progress.tasks[0].fields[verdict] + 1})

    return progress, on_start, on_result


@filter_app.callback(invoke_without_command=True)
@long_command
def filter_tasks_command(
    ctx: typer.Context,
    tasks: str | None = tasks_option(None),
    engine: str | None = engine_option(None, help=ENGINE_DEFAULT_LOCAL_HELP),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(),
    reruns: int | None = typer.Option(None, "--reruns", help="Gold-patch reruns per task (default 3)."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Tasks checked in parallel (default 2; on a Ray "
                                       "engine, the cluster's sandbox slots)."),
    out: Path = out_option(Path("results/runs"), "Where run directories go (or a filter run directory to "
                                                 "resume)."),
    resume: Path | None = typer.Option(None, "--resume", help="Resume this filter-tasks run directory."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N tasks."),
    seed: int | None = seed_option(None, help="Seed of the reruns' hash seeds and test orders (default 0)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds per test run (default 1800)."),
    record_http: bool = typer.Option(False, "--record-http", help="First run each task with an environment "
                                     "once with the gold patch and network, recording its HTTP traffic; "
                                     "every other run replays it with no network."),
) -> None:
    """Filter a task set: pre-check, then the gold patch rerun --reruns times per task; writes
    admitted.jsonl, discarded.jsonl, infra_errors.jsonl and the discard table into a run directory."""
    if ctx.invoked_subcommand is not None:
        return
    from crr.filter import filter_config, filter_tasks, open_run

    run, settings, candidates = open_run({"tasks": tasks, **engine_settings(engine, engine_opt, ray, mode),
                                          "reruns": reruns, "limit": limit, "seed": seed, "timeout": timeout,
                                          "record_http": record_http or None}, out, resume)
    _resume_with(f"crr filter-tasks --resume {shlex.quote(str(run.path))}")
    err_console.print(f"run directory: {run.path}", highlight=False, soft_wrap=True)
    progress, on_start, on_result = _filter_progress()
    with progress:
        summary = filter_tasks(candidates, run, filter_config(settings), workers=workers,
                               on_start=on_start, on_result=on_result)
    console.print((run.path / "discard_table.md").read_text(), highlight=False, markup=False, soft_wrap=True)
    console.print(summary.line(), highlight=False, soft_wrap=True)
    console.print(f"admitted tasks: {run.path / 'admitted.jsonl'}", highlight=False, soft_wrap=True)


@filter_app.command("bench")
@friendly
def filter_bench_command(
    n: int = typer.Option(40, "--n", help="Micro tasks to generate."),
    flaky_rate: float = typer.Option(0.25, "--flaky-rate", help="Fraction of tasks with a planted flaky "
                                     "test."),
    seed: int = seed_option(help="Seed of the micro tasks and of the filter."),
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(),
    reruns: int = typer.Option(3, "--reruns", help="Gold-patch reruns per task."),
    workers: int = typer.Option(2, "--workers", help="Tasks checked in parallel."),
    split: str = typer.Option("train", "--split", help="Micro split: train or test."),
    out: Path = out_option(),
    as_json: bool = json_option("the score"),
) -> None:
    """Score the filter on micro tasks with planted flaky tests: recall of flaky tasks, false
    discards of deterministic ones, infra errors, tasks/min."""
    from rich.table import Table

    from crr.bench.filter import check_bench, filter_bench
    from crr.sandbox import parse_options

    check_bench(n, flaky_rate, split, workers)   # before the line below
    progress, on_start, on_result = _filter_progress()
    err_console.print(f"generating {n} micro tasks (flaky rate {flaky_rate}), then filtering them",
                      highlight=False)
    with progress:
        result = filter_bench(n, flaky_rate, seed, engine=engine, mode=mode, ray=ray, reruns=reruns, workers=workers,
                              engine_options=parse_options(engine_opt or []),
                              out=out, split=split, on_start=on_start, on_result=on_result)
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"crr filter-tasks bench: {engine} engine, n={n}, flaky rate {flaky_rate}, "
                        f"{reruns} reruns, {workers} workers")
    for col in ("flaky kind", "tasks", "discarded", "recall", "missed"):
        table.add_column(col)
    for kind, k in result["per_kind"].items():
        table.add_row(kind, str(k["tasks"]), str(k["discarded"]), f"{k['recall']:.2f}",
                      ", ".join(k["missed"]))
    console.print(table)
    recall = "n/a" if result["recall"] is None else f"{result['recall']:.3f}"
    speed = "n/a" if result["tasks_per_min"] is None else f"{result['tasks_per_min']:.1f}"
    console.print(f"recall {recall} ({result['flaky_discarded']}/{result['flaky_tasks']} flaky tasks "
                  f"discarded; caught by {result['caught_by']}), false discards {result['false_discards']}/"
                  f"{result['deterministic_tasks']} deterministic tasks, infra errors "
                  f"{result['infra_errors']}, {speed} tasks/min", highlight=False, soft_wrap=True)
    console.print(f"run directory: {result['run_dir']}", highlight=False, soft_wrap=True)
