"""`crr credit audit`: the true step advantage by exhaustive forking, and each estimator against it.

torch and transformers are imported inside the command (through crr.credit.audit), never here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from crr.cli.common import (
    _resume_with,
    console,
    emit_json,
    engine_opt_option,
    engine_option,
    engine_settings,
    err_console,
    json_option,
    long_command,
    mode_option,
    out_option,
    progress_bar,
    ray_option,
)

credit_app = typer.Typer(help="Step credit against ground truth: `crr credit audit` forks every step of sampled "
                              "trajectories to measure the true step advantage A*, and scores each advantage "
                              "estimator against it.")


@credit_app.command("audit")
@long_command
def audit_command(
    overrides: list[str] = typer.Argument(None, help="Config overrides key=value (e.g. continuations=8 n_tasks=2)."),
    config: Path | None = typer.Option(None, "--config", help="A preset YAML (e.g. experiments/credit-audit-nano.yaml; "
                                       "default: crr.credit.audit.AuditConfig's defaults)."),
    engine: str | None = engine_option(None, help="Fork engine (default: the config's, local)."),
    ray: str | None = ray_option(),
    mode: str | None = mode_option(),
    engine_opt: list[str] = engine_opt_option(),
    out: Path = out_option(),
    resume: Path | None = typer.Option(None, "--resume", help="Continue an audit run directory (its recorded "
                                       "trajectories are skipped); with variants=..., add fork budgets to it "
                                       "(played on its trajectories, without the oracle)."),
    as_json: bool = json_option("the summary"),
) -> None:
    """For N tasks x G trajectories of a policy: V(s_t) of every step from M on-policy continuations of a fork,
    A*(t) = V(s_t+1) - V(s_t); each estimator's advantages on the same trajectories with its own forks, R
    times. Writes records.jsonl, credit_audit.{md,csv,tex,png,pdf} and summary.json into a run directory."""
    from crr.credit.audit import audit, load_audit_config, parse_overrides, resume_audit, start_audit
    from crr.errors import CRRError
    from crr.report.credit import write_audit

    given = engine_settings(engine, engine_opt, ray, mode)
    if resume is not None:
        added = parse_overrides(overrides or [])
        if config is not None or set(added) - {"variants"} or given:
            raise CRRError("--resume continues a run with its own config; drop --config, engine options and "
                           "overrides other than variants=... (fork budgets to add to it)")
        cfg, run = resume_audit(resume, added.get("variants"))
    else:
        cfg = load_audit_config(config, {**parse_overrides(overrides or []), **given})
        run = start_audit(cfg, out)
    # variants added to a recorded audit reach its config only once every record has them: an interrupted
    # addition resumes with the same variants=... (without, the resume ends at once, the addition half done)
    _resume_with(shlex.join(["crr", "credit", "audit", "--resume", str(run.path),
                             *((overrides or []) if resume is not None else [])]))
    err_console.print(f"run directory: {run.path}", highlight=False)
    progress = progress_bar("credit audit", "{task.fields[rate]}")
    bar = progress.add_task("credit audit", total=None, rate="")

    def on_task(done: int, total: int, info: dict) -> None:
        progress.update(bar, completed=done, total=total,
                        rate=f"{info['rollouts'] / info['wall_s']:.2f} rollouts/s")

    with progress:
        audit(cfg, run, on_task=on_task)
    summary = write_audit(run)
    if as_json:
        emit_json({**summary, "run_dir": str(run.path)})
        return
    console.print((run.path / "credit_audit.md").read_text(), highlight=False, markup=False, soft_wrap=True)
    rate = summary["rollouts_per_s"]
    console.print(f"{summary['trajectories']} trajectories, {summary['oracle_continuations']} oracle continuations, "
                  f"{summary['rollouts']} rollouts in {summary['wall_s']:.0f} s "
                  f"({'n/a' if rate is None else f'{rate:.2f}'} rollouts/s); {run.path}",
                  highlight=False, soft_wrap=True)
