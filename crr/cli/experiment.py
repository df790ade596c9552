"""`crr experiment run`: a whole comparison (every arm and seed trained, evaluated, reported)."""

from __future__ import annotations

from pathlib import Path

import typer

from crr.cli.common import _resume_with, _same_command, console, long_command, out_option

experiment_app = typer.Typer(help="Run a whole comparison (experiments/*.comparison.yaml): train every arm and "
                                  "seed, evaluate, report.", no_args_is_help=True)


@experiment_app.command("run")
@long_command
def experiment_run(
    spec: Path = typer.Argument(..., help="A comparison spec, e.g. experiments/cpu-main.comparison.yaml."),
    out: Path | None = out_option(None, "Where runs/, evals/ and report/ go (default: results/NAME, NAME from the "
                                        "spec)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show each train run's state and command; run nothing."),
    report: bool = typer.Option(True, "--report/--no-report", help="Write the tables and figures at the end."),
    seed: list[int] | None = typer.Option(None, "--seed", help="Only this seed (repeat for several; default: "
                                          "every seed of the spec), e.g. to run the next seed's arms first."),
    arm: list[str] | None = typer.Option(None, "--arm", help="Only this arm (repeat for several; default: every "
                                         "arm of the spec), e.g. to leave the dearest arm for a later session."),
) -> None:
    """Train every arm and seed of the spec (skipping finished runs, resuming interrupted ones), evaluate each
    final model and the checkpoints the spec names, then write `crr report` tables and figures to OUT/report."""
    from crr.comparison import plan, run_comparison
    from crr.errors import CRRError
    from crr.experiments import load_comparison

    comparison = load_comparison(spec)
    out = out or Path("results") / comparison.name
    if out.exists() and not out.is_dir():
        raise CRRError(f"{out} is a file; --out takes the directory runs/, evals/ and report/ go to")
    if dry_run:
        steps = plan(comparison, out, seed, arm)   # an unknown --seed or --arm fails before anything is printed
        console.print(f"[bold]{comparison.name}[/]: {len(comparison.arms)} arms -> {out}", highlight=False)
        for s in steps:
            console.print(f"  {s}", highlight=False, soft_wrap=True, markup=False)
        if comparison.evals:
            console.print("each finished run RUN of arm ARM is then evaluated:", highlight=False)
        for e in comparison.evals:
            at = ", ".join(f"{f:.0%}" for f in e.checkpoint_fractions)
            console.print(f"  {e.command('RUN', out=out / 'evals' / 'ARM')}" + (f" (also at the checkpoints nearest "
                          f"{at} of its wall clock: --checkpoint N)" if at else ""), highlight=False, soft_wrap=True,
                          markup=False)
        return
    _resume_with(_same_command())  # finished runs are skipped, interrupted ones resumed
    statuses = run_comparison(comparison, out, seeds=seed, arms=arm, report=report,
                              say=lambda m: console.print(m, highlight=False, soft_wrap=True))
    if statuses:
        console.print(", ".join(f"{k}: {v}" for k, v in statuses.items()), highlight=False, soft_wrap=True)
