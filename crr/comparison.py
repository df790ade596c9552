"""The comparison driver: every arm and seed of a comparison spec (crr.experiments) trained, every model
evaluated, then `crr report`. Resumable: re-running it skips what is complete, resumes what was interrupted
(`crr train --resume`, `crr eval --resume` semantics) and starts what is absent.

    crr experiment run experiments/cpu-main.comparison.yaml --out results/cpu-main

Layout under `out`: runs/<arm>/ (train run directories), evals/<arm>/ (eval run directories), evals/base/
(the arms' starting model, with `base: true`), report/. An equal-wall-clock arm (`budget_from: crr`) runs after
its source arm, with `budget_hours` set to the ledger wall clock of the source's run of the same seed.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from crr.errors import CRRError
from crr.experiments import Arm, Comparison, EvalSpec
from crr.report.runs import EvalRun, TrainRun, load_runs
from crr.rundir import lock_run

log = logging.getLogger(__name__)


@dataclass
class Step:
    kind: str            # train | eval (the starting model's, `base: true`)
    arm: str             # "base <dataset>" for the starting model's evaluations
    seed: int | None     # None: the starting model
    status: str          # done | resume | todo
    command: str
    path: Path | None = None

    def __str__(self) -> str:
        who = self.arm if self.seed is None else f"{self.arm} seed {self.seed}"
        return f"{who} [{self.status}] {self.command or self.path}"


def ordered_arms(spec: Comparison) -> list[Arm]:
    """The spec's order, except that a matched arm written before its source runs right after it (it needs the
    source's wall clock). The order is the priority of a comparison stopped part-way."""
    order = list(spec.arms.values())
    for arm in [a for a in order if a.budget_from is not None]:
        source = spec.arms[arm.budget_from]
        if order.index(arm) < order.index(source):
            order.remove(arm)
            order.insert(order.index(source) + 1, arm)
    return order


def schedule(spec: Comparison, only: Sequence[int] | None = None,
             arms: Sequence[str] | None = None) -> list[tuple[Arm, int]]:
    """(arm, seed) in the order they run: seed by seed, every arm of a seed together, so that a comparison
    stopped part-way holds complete seeds (paired arms) rather than one arm's every seed; `only`: these seeds,
    `arms`: these arms (by name)."""
    extra = sorted({seed for arm in spec.arms.values() for seed in arm.seeds} - set(spec.seeds))
    seeds = [*spec.seeds, *extra]
    unknown = sorted(set(only or ()) - set(seeds))
    if unknown:
        raise CRRError(f"seed(s) {unknown} are not in {spec.path.name} (its seeds: {seeds})")
    missing = [a for a in arms or () if a not in spec.arms]
    if missing:
        raise CRRError(f"arm(s) {missing} are not in {spec.path.name} (its arms: {', '.join(spec.arms)})")
    return [(arm, seed) for seed in seeds if only is None or seed in only
            for arm in ordered_arms(spec) if seed in arm.seeds and (arms is None or arm.name in arms)]


def _train_runs(out: Path, arm: Arm, seed: int) -> list[TrainRun]:
    folder = out / "runs" / arm.name
    if not any(folder.glob("*/manifest.json")):
        return []
    return sorted((r for r in load_runs([folder]).train if r.seed == seed), key=lambda r: (r.complete, r.path.name))


def _eval_runs(out: Path, arm: Arm, run: TrainRun) -> list[EvalRun]:
    folder = out / "evals" / arm.name
    if not any(folder.glob("*/manifest.json")):
        return []
    return [e for e in load_runs([out / "runs" / arm.name, folder]).evals
            if e.train is not None and e.train.path == run.path]


def plan(spec: Comparison, out: Path, seeds: Sequence[int] | None = None,
         arms: Sequence[str] | None = None) -> list[Step]:
    """The steps and their state: the starting model's evaluations first (`base: true`), then the train runs (the
    evaluations of each finished run follow it)."""
    steps = []
    for ev in spec.base_evals:
        found = base_found(out, ev)
        done = next((e for e in found if e.complete), None)
        what = f"{ev.dataset}{f' x{ev.samples}' if ev.samples > 1 else ''}"
        if done:
            steps.append(Step("eval", f"base {what}", None, "done", "", done.path))
        elif found:   # resumed as _run_eval does
            resume = f"crr eval --resume {shlex.quote(str(found[-1].path))}"
            steps.append(Step("eval", f"base {what}", None, "resume", resume, found[-1].path))
        else:
            steps.append(Step("eval", f"base {what}", None, "todo",
                              ev.command(None, out=base_folder(out), model=spec.base_model)))
    for arm, seed in schedule(spec, seeds, arms):
        runs = _train_runs(out, arm, seed)
        if runs and runs[-1].complete:
            steps.append(Step("train", arm.name, seed, "done", "", runs[-1].path))
        elif runs:
            resume = f"crr train --resume {shlex.quote(str(runs[-1].path))}"
            steps.append(Step("train", arm.name, seed, "resume", resume, runs[-1].path))
        else:
            steps.append(Step("train", arm.name, seed, "todo", arm.train_command(seed, out=out / "runs" / arm.name)))
    return steps


def run_comparison(spec: Comparison, out: Path, *, seeds: Sequence[int] | None = None,
                   arms: Sequence[str] | None = None, report: bool = True,
                   say: Callable[[str], None] = log.info) -> dict:
    """Train, evaluate and report everything the spec asks for (of `seeds` and `arms` only, when given) that
    `out` lacks; returns the report's entries."""
    out.mkdir(parents=True, exist_ok=True)
    lock_run(out, "experiment run")  # one driver per comparison: a second would start the same runs beside it
    for ev in spec.base_evals:       # first: minutes, and every arm is paired with it
        _evaluate_base(spec, ev, out, say)
    for arm, seed in schedule(spec, seeds, arms):
        run = _train(spec, arm, seed, out, say)
        for ev in (e for e in spec.evals if e.covers(arm.name)):
            for step in run.eval_steps(ev.checkpoint_fractions):
                _evaluate(arm, run, ev, step, out, say)
    if not report:
        return {}
    from crr.report import write_plots, write_tables  # deferred: pandas, pyarrow and matplotlib

    _, tables = write_tables([out], out / "report", spec)
    _, figures = write_plots([out], out / "report", spec)
    say(f"report: {out / 'report' / 'report.md'}")
    return {e.name: e.status for e in tables + figures}


def _train(spec: Comparison, arm: Arm, seed: int, out: Path, say: Callable[[str], None]) -> TrainRun:
    from crr.train.config import load_config, parse_overrides
    from crr.train.trainer import resume_run, start_run, train  # deferred: torch and TRL

    runs = _train_runs(out, arm, seed)
    if runs and runs[-1].complete:
        say(f"{arm.name} seed {seed}: done ({runs[-1].path.name})")
        return runs[-1]
    if runs:
        cfg, run, checkpoint = resume_run(runs[-1].path)
        say(f"{arm.name} seed {seed}: resuming {run.path.name} from {checkpoint or 'the start'}")
    else:
        budget = None
        if arm.budget_from is not None:
            source = _train_runs(out, spec.arms[arm.budget_from], seed)
            if not source or not source[-1].complete:
                raise CRRError(f"{arm.name} seed {seed} takes its budget from {arm.budget_from} seed {seed}, which "
                               "has no finished run")
            budget = source[-1].wall_s / 3600
        folder = out / "runs" / arm.name
        # exactly what `crr train` does with the arm's command line (Arm.train_command)
        overrides = {**parse_overrides(arm.overrides), "seed": seed, "output_dir": str(folder)}
        if budget is not None:
            overrides["budget_hours"] = budget
        cfg, checkpoint = load_config(arm.config, overrides), None
        run = start_run(cfg, folder)
        say(f"{arm.name} seed {seed}: {arm.train_command(seed, budget, folder)} -> {run.path.name}")

    def line(r: dict) -> None:
        reward = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.2f}"
        say(f"  {arm.name} seed {seed}: update {r['step']}/{r['max_steps']} R {reward} "
            f"trajectories {r['cumulative']['trajectories']} wall {r['cumulative']['wall_s']:.0f}s")

    train(cfg, run, checkpoint, on_iteration=line)
    done = [r for r in _train_runs(out, arm, seed) if r.path == run.path.resolve()]
    return done[0]


def _evaluate(arm: Arm, run: TrainRun, ev: EvalSpec, step: int, out: Path, say: Callable[[str], None]) -> None:
    final = step == run.updates
    what = f"{arm.name} seed {run.seed} {ev.dataset}{f' x{ev.samples}' if ev.samples > 1 else ''} " \
           f"{'final' if final else f'checkpoint-{step}'}"
    found = [e for e in _eval_runs(out, arm, run) if e.dataset == ev.dataset and e.samples == ev.samples
             and e.made_as(ev.settings) and (e.final if final else e.step == step)]
    folder = out / "evals" / arm.name
    _run_eval(what, found, ev, folder, say, run_dir=run.path, checkpoint=None if final else str(step),
              command=ev.command(str(run.path), None if final else step, folder))


def base_folder(out: Path) -> Path:
    """Where a comparison under `out` keeps the evaluations of the arms' starting model (`base: true`)."""
    return out / "evals" / "base"


def base_found(out: Path, ev: EvalSpec) -> list[EvalRun]:
    """The evaluations of the arms' starting model in base_folder(out) made as the entry `ev` says."""
    folder = base_folder(out)
    return [e for e in (load_runs([folder]).evals if any(folder.glob("*/manifest.json")) else [])
            if e.train is None and e.dataset == ev.dataset and e.samples == ev.samples and e.made_as(ev.settings)]


def _evaluate_base(spec: Comparison, ev: EvalSpec, out: Path, say: Callable[[str], None]) -> None:
    folder, found = base_folder(out), base_found(out, ev)
    _run_eval(f"base policy {ev.dataset}{f' x{ev.samples}' if ev.samples > 1 else ''}", found, ev, folder, say,
              model=spec.base_model, command=ev.command(None, out=folder, model=spec.base_model))


def _run_eval(what: str, found: list[EvalRun], ev: EvalSpec, folder: Path, say: Callable[[str], None], *,
              command: str, **policy) -> None:
    """Evaluate as `command` says into `folder`, unless one of `found` (the same evaluation) is complete: the
    latest of them resumed, else a new one; `policy`: open_eval's model, or run_dir and checkpoint."""
    # deferred: crr.eval loads swebench (~1.3 s), which planning a comparison need not pay
    from crr.eval import evaluate, open_eval, resume_eval

    if any(e.complete for e in found):
        say(f"{what}: done")
        return
    if found:
        config, erun = resume_eval(found[-1].path)
        say(f"{what}: resuming {erun.path.name}")
    else:
        config, erun = open_eval("tasks" if ev.tasks else ev.dataset, str(ev.tasks) if ev.tasks else None,
                                 out=folder, **policy, **ev.settings)
        say(f"{what}: {command}")
    rate = evaluate(config, erun)["pass_at_1"]
    say(f"{what}: pass@1 {'-' if rate is None else f'{rate:.1%}'}")
