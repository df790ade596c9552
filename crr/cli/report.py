"""`crr report tables|plots`: the paper's tables and figures from run directories (pandas and matplotlib
are imported by crr.report, inside the commands)."""

from __future__ import annotations

from pathlib import Path

import typer

from crr.cli.common import console, friendly, out_option

report_app = typer.Typer(help="The paper's tables and figures from run directories only.", no_args_is_help=True)
_RUNS_HELP = "A run directory or a folder holding run directories (searched recursively); repeatable."
_SPEC_HELP = ("The comparison spec the runs belong to (e.g. experiments/multi-main.comparison.yaml): its arms, seeds "
              "and evaluations; default: the shipped specs of the runs' scale.")


def _spec(path: Path | None):
    from crr.experiments import load_comparison

    return None if path is None else load_comparison(path)


def _print_report(kind: str, out: Path, runs, entries) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"crr report {kind}: {len(runs.train)} train runs, {len(runs.evals)} eval runs "
                        f"({runs.scale} scale) -> {out}")
    for col in ("output", "status", "written"):
        table.add_column(col)
    style = {"complete": "green", "partial": "yellow", "missing": "red"}
    for e in entries:
        table.add_row(e.name, f"[{style[e.status]}]{e.status}[/]", " ".join(Path(f).suffix[1:] for f in e.files) or "-")
    console.print(table)
    todo = {m["what"]: m["commands"] for e in entries for m in e.missing}
    if todo:
        console.print(f"[bold]{len(todo)} runs missing[/] (listed with their commands in {out / 'report.md'}):")
        for what, commands in todo.items():
            console.print(f"  {escape(what)}:", highlight=False)
            for c in commands:
                console.print(f"    {escape(c)}", highlight=False, soft_wrap=True)
    console.print(f"index: {out / 'report.md'}", highlight=False)


@report_app.command("tables")
@friendly
def report_tables(
    runs: list[Path] = typer.Option(..., "--runs", help=_RUNS_HELP),
    out: Path = out_option(Path("results/report"), "Where the tables and report.md go."),
    spec: Path | None = typer.Option(None, "--spec", help=_SPEC_HELP),
) -> None:
    """Main results, composition, Search-Select, accounting ledger, equal wall clock, the four ablations, advantage
    SNR and covariance, pass@k and all-n, error taxonomy (shares and absolute rates), per-repository pass@1 and
    the fork composition, each as Markdown, LaTeX (booktabs) and CSV. A table whose runs are missing says which
    runs to make, with the commands."""
    from crr.report import write_tables

    loaded, entries = write_tables(runs, out, _spec(spec))
    _print_report("tables", out, loaded, entries)


@report_app.command("plots")
@friendly
def report_plots(
    runs: list[Path] = typer.Option(..., "--runs", help=_RUNS_HELP),
    out: Path = out_option(Path("results/report"), "Where the figures and report.md go."),
    spec: Path | None = typer.Option(None, "--spec", help=_SPEC_HELP),
) -> None:
    """Sample efficiency (pass@1 against on-policy trajectories and wall clock), training reward, the ablation
    panels (k, selector, horizon, T_cf), advantage SNR and covariance, per-repository pass@1; PNG and PDF."""
    from crr.report import write_plots

    loaded, entries = write_plots(runs, out, _spec(spec))
    _print_report("plots", out, loaded, entries)
