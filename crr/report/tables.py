"""The paper's tables, made from run directories only. Each function takes the loaded runs and returns a
Table: a display frame (Markdown, LaTeX), a tidy numeric frame (CSV), a caption, and the runs still to make
with the commands that make them. Values are means over training seeds; `±` is the seed standard deviation
(ddof 1), shown where two seeds or more exist. Pass rates are percentages, each with its 95 % Wilson interval in
brackets (over the evaluation's tasks: the seeds' models share them; crr.eval.stats); the paired table compares
arms task by task (paired bootstrap intervals, the smallest difference the design resolves).

Which arms and seeds a table needs comes from the comparison specs of the runs' scale (experiments/
{cpu,paper}-*.comparison.yaml); runs that no spec names still appear where they fit (an extra k value joins
the k ablation, an extra seed joins its arm's mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from crr.agent.tools import ToolCallError, parse_tool_call
from crr.eval.passk import KS, pass_hat_k
from crr.eval.stats import CONFIDENCE, POWER, compare, seeds_needed, wilson
from crr.experiments import Comparison, EvalSpec
from crr.report.runs import ArmRef, EvalRun, Runs, TrainRun
from crr.rundir import relative_to_cwd
from crr.train.ledger import PHASES
from crr.train.records import read_records
from crr.train.tuples import read_tuples

ERROR_MODES = {"wrong_localisation": "Wrong loc.", "partial_fix": "Partial fix", "regression": "Regression",
               "harness_subversion": "Harness subv.", "other": "Other"}
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DASH = "—"


@dataclass
class Missing:
    what: str
    commands: list[str]


@dataclass
class Table:
    name: str
    title: str
    caption: str
    display: pd.DataFrame | None = None      # None: nothing to show yet
    data: pd.DataFrame | None = None
    missing: list[Missing] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.display is None or self.display.empty:
            return "missing"
        return "partial" if self.missing else "complete"


# ------------------------------------------------------------------------------------ helpers

def stats(values) -> tuple[float, float, int]:
    """Mean, seed standard deviation (NaN below two values) and count of the non-missing values."""
    v = pd.Series([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], dtype=float)
    return (float(v.mean()) if len(v) else math.nan, float(v.std(ddof=1)) if len(v) > 1 else math.nan, len(v))


def pm(mean: float, std: float = math.nan, digits: int = 1) -> str:
    if mean is None or math.isnan(mean):
        return DASH
    return f"{mean:.{digits}f}" + ("" if std is None or math.isnan(std) else f" ± {std:.{digits}f}")


def pct(x) -> float:
    return math.nan if x is None else 100.0 * float(x)


def rate_ci(found, key: str = "pass_at_1") -> tuple[float, float]:
    """The 95 % Wilson interval (%) of the seeds' mean rate `key` of these evaluations (EvalRuns or summaries),
    over their tasks; NaNs when there is none."""
    summaries = [getattr(e, "summary", e) for e in found if e]
    values = [s[key] for s in summaries if s.get(key) is not None]
    ci = wilson(float(np.mean(values)), min(s["n_instances"] for s in summaries)) if values else None
    return (math.nan, math.nan) if ci is None else (100.0 * ci[0], 100.0 * ci[1])


def with_ci(cell: str, ci: tuple[float, float], digits: int = 1) -> str:
    """A display cell followed by its interval: "39.6 ± 2.4 [28.6, 51.8]"."""
    if cell == DASH or any(math.isnan(x) for x in ci):
        return cell
    return f"{cell} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _wilson_pct(rate_pct: float, n: float) -> tuple[float, float]:
    """The Wilson interval (%) of a rate given in %, over n tasks; NaNs when either is missing."""
    ci = None if math.isnan(rate_pct) or math.isnan(n) else wilson(rate_pct / 100, int(n))
    return (math.nan, math.nan) if ci is None else (100.0 * ci[0], 100.0 * ci[1])


def _eval_label(ev: EvalSpec) -> str:
    return ev.dataset if ev.samples == 1 else f"{ev.dataset} ({ev.samples} samples)"


class Needs:
    """The runs a table uses, per arm and seed; what is absent is recorded as Missing with its commands."""

    def __init__(self, runs: Runs, spec: Comparison | None):
        self.runs, self.spec, self.missing = runs, spec, []

    def _note(self, what: str, *commands: str) -> None:
        if not any(m.what == what for m in self.missing):
            self.missing.append(Missing(what, list(commands)))

    def train(self, ref: ArmRef) -> list[TrainRun]:
        """The complete runs of `ref`, one per seed (the latest); the spec's seeds that lack one are noted."""
        runs = {}
        for r in self.runs.of_arm(ref, complete=False):
            if r.seed not in runs or (r.complete, r.path.name) > (runs[r.seed].complete, runs[r.seed].path.name):
                runs[r.seed] = r
        if ref.arm is not None and self.spec is not None and ref.arm.name in self.spec.arms:
            for seed in self.spec.arms[ref.arm.name].seeds:
                run = runs.get(seed)
                if run is None:
                    ev = self.spec.evals[0] if self.spec.evals else None
                    cmds = [ref.arm.train_command(seed, self._budget(ref, seed))]
                    if ev is not None:
                        cmds.append(ev.command(f"<run directory of {ref.label} seed {seed}>"))
                    self._note(f"{ref.label}, seed {seed}: train run", *cmds)
                elif not run.complete:
                    self._note(f"{ref.label}, seed {seed}: train run not finished ({shown(run.path)})",
                               f"crr train --resume {shown(run.path)}")
        return [r for _, r in sorted(runs.items()) if r.complete]

    def _budget(self, ref: ArmRef, seed: int) -> float | None:
        """The matched budget (hours) of an equal-wall-clock arm: its source arm's wall clock at this seed."""
        if ref.arm is None or ref.arm.budget_from is None or self.spec is None:
            return None
        source = self.runs.catalogue.ref(self.spec, ref.arm.budget_from)
        done = [r for r in self.runs.of_arm(source) if r.seed == seed]
        return round(done[-1].wall_s / 3600, 6) if done else None

    def planned(self, run: TrainRun, ev: EvalSpec) -> set[int]:
        """The updates whose `ev`-kind evaluation the spec asks for (what `crr experiment run` evaluates): the
        final model and the checkpoints at the checkpoint_fractions of every eval of that dataset and sample count
        covering the run's arm."""
        if self.spec is None or run.arm.arm is None:
            return {run.updates}
        return {step for e in self.spec.evals if e.dataset == ev.dataset and e.samples == ev.samples
                and e.covers(run.arm.arm.name) for step in run.eval_steps(e.checkpoint_fractions)}

    def eval(self, run: TrainRun, ev: EvalSpec, step: int | None = None) -> EvalRun | None:
        """The run's evaluation of this kind at `step` (None: the final model); noted missing only where the
        spec asks for it."""
        found = self.runs.evals_of(run, ev.dataset, samples=1 if ev.samples == 1 else None, step=step,
                                   settings=ev.settings)
        if found is None and run.arm.arm is not None and ev.covers(run.arm.arm.name) \
                and (step is None or step in self.planned(run, ev)):
            final = step is None or step == run.updates
            self._note(f"{run.arm.label}, seed {run.seed}: {_eval_label(ev)} eval of the "
                       f"{'final model' if final else f'update-{step} checkpoint'}",
                       ev.command(shown(run.path), None if final else step))
        return found


def shown(path: Path) -> str:
    """A run's path as a report's commands name it: relative to the working directory when under it."""
    return relative_to_cwd(path) or str(path)


def _main_spec(runs: Runs) -> Comparison | None:
    return runs.catalogue.spec("main")


def _evals(spec: Comparison | None, runs: Runs, *, sampled: bool = False) -> list[EvalSpec]:
    """The spec's evaluations of final models (greedy, or sampled), plus datasets only the runs have."""
    out = []
    for e in (spec.evals if spec else []):   # one per dataset: another entry may add checkpoints of some arms
        if (e.samples > 1) == sampled and e.dataset not in {x.dataset for x in out}:
            out.append(e)
    for e in runs.evals:
        if e.train is not None and (e.samples > 1) == sampled and e.dataset not in {x.dataset for x in out}:
            out.append(EvalSpec(e.dataset, settings={"samples": e.samples} if sampled else {}))
    return out


def _primary(spec: Comparison | None, runs: Runs, *, sampled: bool = False) -> EvalSpec | None:
    """The evaluation single-benchmark tables use: the spec's first one with results, else the first."""
    evals = _evals(spec, runs, sampled=sampled)
    have = {(e.dataset, e.samples > 1) for e in runs.evals if e.complete and e.train is not None}
    return next((e for e in evals if (e.dataset, sampled) in have), evals[0] if evals else None)


def base_evals(runs: Runs, needs: Needs, ev: EvalSpec) -> dict[str, EvalRun]:
    """The complete evaluations of this kind of untrained models (no train run: the base policy the arms start
    from), the latest per label (of those made as `ev` says, if any); a spec with `base: true` that lacks one has
    it noted with its command."""
    found = {}
    for e in sorted(runs.evals, key=lambda e: (e.made_as(ev.settings), e.path.name)):
        if e.complete and e.config.get("train_run") is None and e.dataset == ev.dataset and e.samples == ev.samples:
            found[e.label] = e
    spec = needs.spec
    if not found and spec is not None and any((b.dataset, b.samples) == (ev.dataset, ev.samples)
                                              for b in spec.base_evals):
        needs._note(f"base policy: {_eval_label(ev)} eval", ev.command(None, model=spec.base_model))
    return found


def main_arms(runs: Runs, spec: Comparison | None) -> tuple[list[ArmRef], ArmRef | None]:
    """The arms of the main comparison (no budget: the equal-trajectory endpoints) and the CRR reference: the
    spec's arms without a matched budget, plus any present arm with the same defaults."""
    cat = runs.catalogue
    refs = [cat.ref(spec, a.name) for a in spec.arms.values() if a.budget_from is None] if spec else []
    crr = next((r for r in refs if r.method == "crr"), None)
    for run in runs.train:
        r = run.arm
        if r not in refs and r.key[2] is None and (crr is None or r.method == "grpo" or r.key[1] == crr.key[1]):
            refs.append(r)
    order = {"grpo": 0, "search-select": 1, "crr": 2}
    return sorted(refs, key=lambda r: (order.get(r.method, 3), r.label)), crr


# the specs' arm names as the tables print them
ARM_LABELS = {"grpo": "GRPO", "crr": "CRR", "search-select": "Search-Select-GRPO",
              "grpo-equal-wall-clock": "GRPO (equal wall clock)", "crr-k2": "CRR (K = 2)",
              "zero-contrast": "zero-contrast control", "gigpo": "GiGPO", "mc-values": "Monte-Carlo values",
              "crr-mid-value": "CRR (mid-value forks)", "crr-h2": "CRR (h = 2)", "resets": "resets (SRPO-style)"}


def _label(ref: ArmRef) -> str:
    return ARM_LABELS.get(ref.label, ref.label)


# ------------------------------------------------------------------------------------ tables

def main_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    evals = _evals(spec, runs)
    rows = []
    for ref in arms:
        trained = needs.train(ref)
        for ev in evals:
            found = [e for e in (needs.eval(r, ev) for r in trained) if e]
            m, s, n = stats(pct(e.summary["pass_at_1"]) for e in found)
            rows.append({"arm": _label(ref), "dataset": ev.dataset, "pass_at_1": m, "std": s, "seeds": n,
                         **dict(zip(("ci_low", "ci_high"), rate_ci(found)))})
    for ev in evals:   # the starting policies: one fixed model each, no seeds
        for label, e in sorted(base_evals(runs, needs, ev).items()):
            m, s, n = stats([pct(e.summary["pass_at_1"])])
            rows.append({"arm": label, "dataset": ev.dataset, "pass_at_1": m, "std": s, "seeds": n,
                         **dict(zip(("ci_low", "ci_high"), rate_ci([e])))})
    data = pd.DataFrame(rows, columns=["arm", "dataset", "pass_at_1", "std", "seeds", "ci_low", "ci_high"])
    table = Table("main", "Main results: pass@1 (%)",
                  "Pass@1 (%) of each method's final model; means ± seed standard deviations over training seeds, "
                  "[the 95 % Wilson interval of the mean over the benchmark's tasks]. The last column is the "
                  "difference from GRPO on the first benchmark (its paired intervals: the paired table). These "
                  "endpoint runs have equal on-policy trajectories, not equal compute (see the accounting table).",
                  data=data, missing=needs.missing)
    if data["seeds"].sum() == 0:
        return table
    datasets = list(dict.fromkeys(data["dataset"]))
    display = pd.DataFrame({"Method": list(dict.fromkeys(data["arm"]))})
    for ds in datasets:
        cell = {r.arm: with_ci(pm(r.pass_at_1, r.std), (r.ci_low, r.ci_high))
                for r in data[data.dataset == ds].itertuples()}
        display[ds] = [cell.get(a, DASH) for a in display["Method"]]
    first = data[data.dataset == datasets[0]].set_index("arm")["pass_at_1"]
    if "GRPO" in first.index and not math.isnan(first["GRPO"]):
        display["Δ vs GRPO"] = [DASH if math.isnan(first.get(a, math.nan)) else f"{first[a] - first['GRPO']:+.1f}"
                                for a in display["Method"]]
    table.display = display
    return table


def composition_table(runs: Runs) -> Table:
    main = main_table(runs)
    table = Table("composition", "Composition: GRPO with and without CRR, pass@1 (%)",
                  "Pass@1 (%) of base GRPO and GRPO + CRR (seed means). The paper's TSR, PRM and TSR+PRM columns "
                  "compose CRR with trajectory search and a process reward model, which crr does not implement; "
                  "only the 'none' column can be made from crr runs.", missing=main.missing)
    d = main.data[main.data.arm.isin(["GRPO", "CRR"])]
    if d["seeds"].sum() == 0:
        return table
    wide = d.pivot(index="dataset", columns="arm", values="pass_at_1").reindex(columns=["GRPO", "CRR"])
    rows = [{"Configuration": name, **{f"{ds} (none)": pm(wide.at[ds, arm]) for ds in wide.index}}
            for name, arm in (("Base GRPO", "GRPO"), ("Base GRPO + CRR", "CRR"))]
    rows.append({"Configuration": "CRR gain", **{f"{ds} (none)": DASH if wide.loc[ds].isna().any() else
                                                 f"{wide.at[ds, 'CRR'] - wide.at[ds, 'GRPO']:+.1f}"
                                                 for ds in wide.index}})
    table.display, table.data = pd.DataFrame(rows), wide.reset_index()
    return table


def search_select_table(runs: Runs) -> Table:
    spec = runs.catalogue.spec("search-select", "main")
    needs = Needs(runs, spec)
    ev = _primary(spec, runs)
    use = {"grpo": "None", "search-select": "Select the training sequence",
           "crr": "Credit assignment on realised actions"}
    arms = [runs.catalogue.ref(spec, a.name) for a in spec.arms.values()
            if a.budget_from is None and runs.catalogue.ref(spec, a.name).method in use] if spec else []
    arms.sort(key=lambda r: list(use).index(r.method))
    rows = []
    for ref in arms:
        trained = needs.train(ref)
        found = [needs.eval(r, ev) for r in trained] if ev else []
        m, s, n = stats(pct(e.summary["pass_at_1"]) for e in found if e)
        lo, hi = rate_ci(found)
        rm, _, _ = stats(pct(sum(x.get("replaced") or 0 for x in r.metrics.values())
                             / max(1, r.cumulative(r.updates)["trajectories"]))
                         for r in trained) if ref.method == "search-select" else (math.nan, 0, 0)
        rows.append({"arm": _label(ref), "fork_use": use[ref.method], "pass_at_1": m, "std": s, "seeds": n,
                     "ci_low": lo, "ci_high": hi, "replacement_rate": rm, "train_runs": len(trained)})
    data = pd.DataFrame(rows, columns=["arm", "fork_use", "pass_at_1", "std", "seeds", "ci_low", "ci_high",
                                       "replacement_rate", "train_runs"])
    table = Table("search_select", "Credit assignment versus Search-Select",
                  f"Two uses of the same forks: Search-Select replaces a realised sequence by a strictly better "
                  f"branch, CRR keeps it and uses the return differential. Pass@1 (%) on "
                  f"{ev.dataset if ev else 'the eval set'}, means ± seed standard deviations [95 % Wilson interval]; "
                  "the replacement rate is the share of realised trajectories replaced.",
                  data=data, missing=needs.missing)
    if data["train_runs"].sum():
        table.display = pd.DataFrame({"Method": data.arm, "Use of forks": data.fork_use,
                                      "Pass@1 (%)": [with_ci(pm(r.pass_at_1, r.std), (r.ci_low, r.ci_high))
                                                     for r in data.itertuples()],
                                      "Replaced (%)": [pm(x) for x in data.replacement_rate]})
    return table


def _unit(seconds: float) -> tuple[float, str]:
    return (3600.0, "h") if seconds >= 3600 else (1.0, "s")


def accounting_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    ev = _primary(spec, runs)
    per_arm = {}
    for ref in arms:
        trained = needs.train(ref)
        if trained:
            per_arm[_label(ref)] = (trained, [needs.eval(r, ev) for r in trained] if ev else [])
    table = Table("accounting", "Resource accounting (ledger)",
                  "The training ledger per method (means over seeds): each second of an iteration is charged to one "
                  "phase; the counterfactual fork pool is fork/materialisation + counterfactual rollout + "
                  "counterfactual tests; 'unattributed' is wall clock no phase claims. Times are node wall clock; "
                  "multiply by the node's device count for device-time (the paper's H100-hours).",
                  missing=needs.missing)
    if not per_arm:
        return table
    records = []
    for arm, (trained, _found) in per_arm.items():
        for r in trained:
            c = r.cumulative(r.updates)
            records.append({"arm": arm, "seed": r.seed, **{k: c[k] for k in (*PHASES, "wall_s", "trajectories",
                            "updates", "forks", "generated_tokens_on_policy", "generated_tokens_all",
                            "effective_tokens")},
                            "cf_pool_s": c["fork_s"] + c["cf_rollout_s"] + c["cf_test_s"],
                            "cf_tokens": c["generated_tokens_all"] - c["generated_tokens_on_policy"],
                            # (NaN in a ledger from before the count: the row shows a dash)
                            **{k: c.get(k, math.nan) for k in ("observed_tokens_on_policy", "observed_tokens_all")},
                            "cf_observed_tokens": c.get("observed_tokens_all", math.nan)
                            - c.get("observed_tokens_on_policy", math.nan),
                            "unattributed_s": c["wall_s"] - sum(c[k] for k in PHASES)})
    data = pd.DataFrame(records)
    means = data.groupby("arm", sort=False).mean(numeric_only=True)
    scale, unit = _unit(float(means["wall_s"].max()))
    rows = [(f"On-policy rollout ({unit})", "rollout_s"), (f"Counterfactual fork pool ({unit})", "cf_pool_s"),
            (f"  fork / materialisation ({unit})", "fork_s"), (f"  counterfactual rollout ({unit})", "cf_rollout_s"),
            (f"  counterfactual tests ({unit})", "cf_test_s"), (f"Learner updates ({unit})", "update_s"),
            (f"Unattributed ({unit})", "unattributed_s"), (f"Total wall clock ({unit})", "wall_s")]
    display = [{"Accounting item": name, **{a: f"{means.at[a, k] / scale:.2f}" for a in means.index}}
               for name, k in rows]
    # what a branch costs beside an on-policy trajectory (issue 29's target: at most half), how long it is (the
    # tokens it generated and those it was fed), and what a generated token costs in each (a branch's own tokens
    # only): numerator / denominator x scale, per arm
    ratios = [("Seconds per on-policy trajectory", "rollout_s", "trajectories", 1, ".2f"),
              ("Seconds per fork (its fork pool share)", "cf_pool_s", "forks", 1, ".2f"),
              ("Generated tokens per on-policy trajectory", "generated_tokens_on_policy", "trajectories", 1, ".0f"),
              ("Generated tokens per fork", "cf_tokens", "forks", 1, ".0f"),
              ("Observed tokens per on-policy trajectory", "observed_tokens_on_policy", "trajectories", 1, ".0f"),
              ("Observed tokens per fork", "cf_observed_tokens", "forks", 1, ".0f"),
              ("Milliseconds per generated token, on-policy rollout", "rollout_s", "generated_tokens_on_policy", 1e3,
               ".2f"),
              ("Milliseconds per generated token, fork pool", "cf_pool_s", "cf_tokens", 1e3, ".2f")]
    for name, num, den, times, fmt in ratios:
        display.append({"Accounting item": name, **{
            a: DASH if not means.at[a, den] or math.isnan(means.at[a, num])
            else f"{times * means.at[a, num] / means.at[a, den]:{fmt}}" for a in means.index}})
    for name, k in (("On-policy trajectories", "trajectories"), ("Optimizer updates", "updates"), ("Forks", "forks"),
                    ("Generated tokens, on-policy", "generated_tokens_on_policy"),
                    ("Generated tokens, all", "generated_tokens_all"), ("Effective tokens", "effective_tokens")):
        display.append({"Accounting item": name, **{a: f"{means.at[a, k]:,.0f}" for a in means.index}})
    if ev is not None:
        display.append({"Accounting item": f"{ev.dataset} pass@1 (%)", **{
            a: with_ci(pm(*stats(pct(e.summary["pass_at_1"]) for e in found if e)[:2]), rate_ci(found))
            for a, (_, found) in per_arm.items()}})
    table.display, table.data = pd.DataFrame(display), data
    return table


def wallclock_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    matched = [a for a in spec.arms.values() if a.budget_from] if spec else []
    table = Table("wallclock", "Equal wall clock",
                  "Each column is a fraction of the CRR run's training window (ledger wall clock; per seed), each "
                  "value the state at the saved checkpoint closest to that time (observed, not interpolated): pass@1 "
                  "(%) [95 % Wilson interval], completed on-policy trajectories, optimizer updates and "
                  "generated/effective tokens, means over seeds (pass@1 where the spec evaluates that checkpoint). The "
                  "GRPO arm is given the CRR run's measured wall clock as its budget.",
                  missing=needs.missing)
    if not matched:
        table.notes.append("the comparison spec has no equal-wall-clock arm (budget_from)")
        return table
    ev = _primary(spec, runs)
    arm = matched[0]
    source_ref, arm_ref = runs.catalogue.ref(spec, arm.budget_from), runs.catalogue.ref(spec, arm.name)
    sources = {r.seed: r for r in needs.train(source_ref)}
    records = []
    for ref in (arm_ref, source_ref):
        for run in needs.train(ref):
            window = sources.get(run.seed)
            if window is None:
                continue
            for f in FRACTIONS:
                step = run.step_at(f * window.wall_s)
                if step is None:
                    continue
                c = run.cumulative(step)
                found = needs.eval(run, ev, step) if ev else None
                records.append({"arm": _label(ref), "seed": run.seed, "fraction": f, "hours": f * window.wall_s / 3600,
                                "step": step, "wall_s": c["wall_s"],
                                "pass_at_1": pct(found.summary["pass_at_1"]) if found else math.nan,
                                "instances": found.summary["n_instances"] if found else math.nan,
                                **{k: c[k] for k in ("trajectories", "updates", "generated_tokens_on_policy",
                                                     "generated_tokens_all", "effective_tokens")}})
    if not records:
        return table
    data = pd.DataFrame(records)
    mean = data.groupby(["arm", "fraction"], sort=False).mean(numeric_only=True)
    hours = (mean.xs(_label(source_ref), level="arm")["hours"] if _label(source_ref) in mean.index.get_level_values(0)
             else None)
    cols = [f"{f:.0%}" for f in FRACTIONS]
    sec, unit = _unit(float(data["hours"].max() * 3600))
    rows = [{"": f"Wall clock ({unit})", **{c: f"{hours[f] * 3600 / sec:.3f}" if hours is not None and f in hours.index
                                            else DASH for c, f in zip(cols, FRACTIONS)}}]
    for arm_label in dict.fromkeys(data["arm"]):
        m = mean.xs(arm_label, level="arm")
        for name, k, digits in (("pass@1 (%)", "pass_at_1", 1), ("on-policy trajectories", "trajectories", 0),
                                ("optimizer updates", "updates", 0),
                                ("generated tokens, on-policy", "generated_tokens_on_policy", 0),
                                ("generated tokens, all", "generated_tokens_all", 0),
                                ("effective tokens", "effective_tokens", 0)):
            cells = {c: f"{m.at[f, k]:,.{digits}f}" if f in m.index and not math.isnan(m.at[f, k]) else DASH
                     for c, f in zip(cols, FRACTIONS)}
            if k == "pass_at_1":
                cells = {c: with_ci(cells[c], _wilson_pct(m.at[f, k], m.at[f, "instances"])) if f in m.index
                         else cells[c] for c, f in zip(cols, FRACTIONS)}
            rows.append({"": f"{arm_label} {name}", **cells})
    table.display, table.data = pd.DataFrame(rows).rename(columns={"": "Fraction of CRR training window"}), data
    return table


# Ablation factors: (config keys varied, column title, how a value reads)
FACTORS: dict[str, tuple[set[str], str]] = {
    "k": ({"k"}, "Fork budget k"),
    "selector": ({"selector"}, "Selector"),
    "horizon": ({"horizon"}, "Counterfactual horizon h"),
    "cf_temperature": ({"cf_temperature", "zero_contrast"}, "Proposal temperature T_cf"),
}


def _factor_value(ref: ArmRef, factor: str):
    if factor == "cf_temperature" and ref.value("zero_contrast"):
        return "0 (zero-contrast)"
    value = ref.value(factor)
    return "full" if factor == "horizon" and value is None else value


def _sort_key(value) -> tuple:
    if isinstance(value, (int, float)):
        return (1, value, "")
    return (0, 0, value) if str(value).startswith("0 (") else (2, 0, str(value))


def ablation_table(runs: Runs, factor: str) -> Table:
    keys, title = FACTORS[factor]
    spec = runs.catalogue.spec("ablations")
    needs = Needs(runs, spec)
    table = Table(f"ablation_{factor}", f"Ablation: {title}",
                  f"{title} varied alone from the CRR preset ('default' marks the preset's value). Pass@1 (%) of the "
                  "final model [95 % Wilson interval] and mean training reward (%), means ± seed standard deviations; "
                  "for k and h also forks per trajectory and the wall clock relative to the default.",
                  missing=needs.missing)
    if spec is None or "crr" not in spec.arms:
        table.notes.append(f"no {runs.scale}-ablations comparison spec with a `crr` arm")
        return table
    ref0 = runs.catalogue.ref(spec, "crr")
    refs = [ref0] + [r for r in runs.catalogue.arms.values() if r.differs_only_in(ref0, keys)
                     and (r.arm is not None and r.arm.name in spec.arms or runs.of_arm(r))]
    ev = _primary(spec, runs)
    rows = []
    for ref in refs:
        trained = needs.train(ref)
        found = [needs.eval(r, ev) for r in trained] if ev else []
        m, s, n = stats(pct(e.summary["pass_at_1"]) for e in found if e)
        lo, hi = rate_ci(found)
        rm, rs, _ = stats(pct(np.mean([x for x in (it.get("reward_mean") for it in r.metrics.values())
                                       if x is not None]))
                          for r in trained if any(it.get("reward_mean") is not None for it in r.metrics.values()))
        wall, _, _ = stats(r.wall_s for r in trained)
        forks, _, _ = stats(r.cumulative(r.updates)["forks"] / max(1, r.cumulative(r.updates)["trajectories"])
                            for r in trained)
        rows.append({"value": _factor_value(ref, factor), "arm": ref.label, "default": ref is ref0, "pass_at_1": m,
                     "std": s, "seeds": n, "ci_low": lo, "ci_high": hi, "train_reward": rm, "train_reward_std": rs,
                     "wall_s": wall, "forks_per_trajectory": forks, "train_runs": len(trained)})
    data = pd.DataFrame(rows)
    data = data.iloc[sorted(range(len(data)), key=lambda i: _sort_key(data.at[i, "value"]))].reset_index(drop=True)
    default_wall = data.loc[data["default"], "wall_s"].iloc[0]
    data["relative_wall"] = data["wall_s"] / default_wall if default_wall and not math.isnan(default_wall) else math.nan
    table.data = data
    if data["train_runs"].sum() == 0:
        return table
    display = pd.DataFrame({title: [f"{v} (default)" if d else str(v) for v, d in zip(data.value, data.default)],
                            "Pass@1 (%)": [with_ci(pm(r.pass_at_1, r.std), (r.ci_low, r.ci_high))
                                           for r in data.itertuples()],
                            "Train reward (%)": [pm(r.train_reward, r.train_reward_std) for r in data.itertuples()]})
    if factor in ("k", "horizon"):   # what they trade: forks, or a branch's length, against wall clock
        display["Forks / trajectory"] = [pm(x, digits=2) for x in data.forks_per_trajectory]
        display["Relative wall clock"] = [DASH if math.isnan(x) else f"{x:.2f}x" for x in data.relative_wall]
    table.display = display
    return table


def _mean_over_updates(run: TrainRun, name: str) -> float:
    values = [r.get(name) for r in run.metrics.values() if r.get(name) is not None]
    return float(np.mean(values)) if values else math.nan


def _mean_covariance(run: TrainRun) -> float:
    values = [r["covariance"]["cov"] for r in run.metrics.values()
              if (r.get("covariance") or {}).get("cov") is not None]
    return float(np.mean(values)) if values else math.nan


def snr_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    rows = []
    for ref in arms:
        trained = needs.train(ref)
        m, s, n = stats(_mean_over_updates(r, "advantage_snr") for r in trained)
        cm, cs, _ = stats(_mean_covariance(r) for r in trained)
        rows.append({"arm": _label(ref), "advantage_snr": m, "std": s, "seeds": n, "covariance": cm,
                     "covariance_std": cs, "train_runs": len(trained)})
    data = pd.DataFrame(rows, columns=["arm", "advantage_snr", "std", "seeds", "covariance", "covariance_std",
                                       "train_runs"])
    grpo = data.set_index("arm")["advantage_snr"].get("GRPO", math.nan)
    data["relative_to_grpo"] = data["advantage_snr"] / grpo if grpo and not math.isnan(grpo) else math.nan
    table = Table("snr", "Advantage SNR and return covariance",
                  "Per-step advantage SNR (mean |A*_t| over its standard deviation across the rollout pool), averaged "
                  "over the updates where it was recorded, and the task/prefix-bucket covariance Cov(R(tau), "
                  "R(tilde tau_t) | B) averaged over updates (forking methods only); means ± seed standard deviations.",
                  data=data, missing=needs.missing)
    if data["train_runs"].sum():
        table.display = pd.DataFrame({
            "Method": data.arm, "Advantage SNR": [pm(r.advantage_snr, r.std, 3) for r in data.itertuples()],
            "Relative to GRPO": [DASH if math.isnan(x) else f"{x:.2f}x" for x in data.relative_to_grpo],
            "Bucket covariance": [pm(r.covariance, r.covariance_std, 3) for r in data.itertuples()]})
    return table


def covariance_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    _, crr = main_arms(runs, spec)
    table = Table("covariance", "Bucket covariance during training",
                  "Empirical task/prefix-bucket covariance of realised and counterfactual returns at five points of "
                  "CRR training (the diagnostic recorded at or before each update), means over seeds; the 5th/95th "
                  "percentiles are over buckets.", missing=needs.missing)
    trained = needs.train(crr) if crr else []
    records = []
    for run in trained:
        for step, rec in sorted(run.metrics.items()):
            cov = rec.get("covariance") or {}
            if cov.get("cov") is not None:
                records.append({"seed": run.seed, "step": step, "fraction": step / run.updates,
                                **{k: cov.get(k) for k in ("cov", "cov_p5", "cov_p95", "pairs", "buckets")}})
    if not records:
        if trained:
            table.notes.append("no update of the CRR runs recorded a covariance (a bucket needs two pairs)")
        return table
    data = pd.DataFrame(records)
    points = []
    for f in (0.05, 0.25, 0.5, 0.75, 1.0):   # the paper's 200 / 1,000 / 2,000 / 3,000 / 4,000 of 4,000 updates
        at = data[data.fraction <= f + 1e-9].sort_values("step").groupby("seed").tail(1)
        if not at.empty and (not points or at["step"].mean() != points[-1][1]["step"].mean()):
            points.append((f, at))
    cols = {f"update {at['step'].mean():.0f}": at for _, at in points}
    rows = [{"": name, **{c: f"{at[k].mean():.3f}" if at[k].notna().any() else DASH for c, at in cols.items()}}
            for name, k in (("Cov (mean)", "cov"), ("Cov (5th pct.)", "cov_p5"), ("Cov (95th pct.)", "cov_p95"))]
    rows.append({"": "pairs", **{c: f"{at['pairs'].mean():.0f}" for c, at in cols.items()}})
    table.display, table.data = pd.DataFrame(rows).rename(columns={"": "Step"}), data
    return table


def passk_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    greedy, sampled = _primary(spec, runs), _primary(spec, runs, sampled=True)
    table = Table("passk", "Multiple-sample evaluation: pass@k, pass^k and all-n",
                  "Greedy pass@1 and, from n sampled trajectories per instance, sampled pass@1, the unbiased pass@k "
                  "estimate (some of k drawn samples solve the task), pass^k (all k drawn solve it) and all-n (the "
                  "share of instances every sample solves, pass^n); percentages, means over seeds, [95 % Wilson "
                  "interval over the instances]. A base policy row is the untrained model the arms start from.",
                  missing=needs.missing)
    if sampled is None:
        table.notes.append("no comparison spec or run has a sampled (--samples N > 1) evaluation")
        return table

    def row(arm: str, seed: int | None, g: EvalRun | None, s: EvalRun | None) -> dict:
        return {"arm": arm, "seed": seed, "greedy_pass_at_1": pct(g.summary["pass_at_1"]) if g else math.nan,
                "greedy_instances": g.summary["n_instances"] if g else math.nan,
                **({f"pass_at_{k}": pct(v) for k, v in s.summary["pass_at_k"].items()} if s else {}),
                **({f"pass_hat_{k}": pct(v) for k, v in (s.summary.get("pass_hat_k") or _pass_hat(s)).items()
                    if k != "1"} if s else {}),
                "all_n": pct(s.summary["all_n"]) if s else math.nan, "samples": s.samples if s else math.nan,
                "instances": s.summary["n_instances"] if s else math.nan}

    base_g, base_s = base_evals(runs, needs, greedy) if greedy else {}, base_evals(runs, needs, sampled)
    rows = [row(label, None, base_g.get(label), base_s.get(label)) for label in dict.fromkeys([*base_g, *base_s])]
    for ref in arms:
        for run in needs.train(ref):
            rows.append(row(_label(ref), run.seed, needs.eval(run, greedy) if greedy else None,
                            needs.eval(run, sampled)))
    if not rows:
        return table
    data = pd.DataFrame(rows)
    table.data = data
    if data.drop(columns=["arm", "seed"]).isna().all().all():
        return table
    order = lambda c: int(c.rsplit("_", 1)[1])  # noqa: E731
    ks = sorted((c for c in data.columns if c.startswith("pass_at_")), key=order)
    hats = sorted((c for c in data.columns if c.startswith("pass_hat_")), key=order)
    rates = ["greedy_pass_at_1", *ks, *hats, "all_n"]
    mean = data.groupby("arm", sort=False).mean(numeric_only=True)
    for frame in (data, mean):    # each seed's interval (the CSV) and that of the seeds' mean (the display)
        for c in rates:
            cis = [_wilson_pct(x, i) for x, i in zip(frame[c], frame["greedy_instances" if c.startswith("greedy")
                                                                       else "instances"])]
            frame[f"{c}_ci_low"], frame[f"{c}_ci_high"] = [lo for lo, _ in cis], [hi for _, hi in cis]
    n = int(np.nanmax(mean["samples"])) if mean["samples"].notna().any() else sampled.samples
    cell = lambda c: [with_ci(pm(x), (lo, hi)) for x, lo, hi in zip(mean[c], mean[f"{c}_ci_low"], mean[f"{c}_ci_high"])]  # noqa: E731
    display = pd.DataFrame({"Method": mean.index, "Pass@1 greedy": cell("greedy_pass_at_1")})
    for c in ks:
        display["Pass@1 sampled" if c == "pass_at_1" else f"Pass@{order(c)}"] = cell(c)
    for c in hats:
        display[f"Pass^{order(c)}"] = cell(c)
    display[f"All-{n}"] = cell("all_n")
    table.display = display
    return table


def _pass_hat(e: EvalRun) -> dict[str, float]:
    """pass^k of an evaluation whose summary predates it (crr eval before pass^k), from its per-task records."""
    counts = e.task_counts.values()
    return {str(k): float(np.mean([pass_hat_k(n, c, k) for n, c in counts if n >= k]))
            for k in KS if 1 < k <= e.samples}


TARGET_POINTS = 3.0   # the difference a powered comparison should resolve (issue 30), on
PLAN_TASKS = 256      # held-out tasks: the seeds per arm that takes


def _pairs(runs: Runs, spec: Comparison | None) -> list[tuple[ArmRef, ArmRef]]:
    """(A, B) arm pairs a paired table compares: every main arm against GRPO, and CRR against GRPO at its wall
    clock (the equal-wall-clock arm against its source)."""
    arms, _ = main_arms(runs, spec)
    grpo = next((r for r in arms if r.method == "grpo"), None)
    pairs = [(r, grpo) for r in arms if grpo is not None and r is not grpo]
    for arm in (a for a in spec.arms.values() if a.budget_from) if spec else ():
        pairs.append((runs.catalogue.ref(spec, arm.budget_from), runs.catalogue.ref(spec, arm.name)))
    return pairs


def paired_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    level, power = round(100 * (1 - CONFIDENCE)), round(100 * POWER)
    table = Table("paired", "Paired comparisons between arms (points)",
                  "A minus B in pass@1 points on the tasks both were evaluated on (each arm's mean over its seeds' "
                  "final models, task by task). 95 % intervals: a paired bootstrap over tasks (10,000 replicates, "
                  "RNG seed 0), with the seeds' models fixed, and over tasks and seeds (each arm's seeds resampled "
                  "too). Tasks A / B ahead: tasks one arm solves more often than the other (one seed each: solves "
                  "and the other does not). Resolves: the smallest difference this design detects with "
                  f"{power} % power in a two-sided test at alpha {level / 100:.2f}: (z_0.975 + z_0.8) sqrt(Var(D)), "
                  "Var(D) = var_t(d_t) / T + sigma_seed,A^2 / S_A + sigma_seed,B^2 / S_B over the T per-task "
                  "differences d_t and each arm's seed-to-seed variance (two-way ANOVA, tasks x seeds); the last "
                  f"column: the seeds per arm that would resolve {TARGET_POINTS:g} points on {PLAN_TASKS} tasks "
                  "with the same variance components (crr.eval.stats.compare). B = base policy: the untrained model "
                  "every arm starts from, one fixed model without seed-to-seed variance (compare's fixed_b).",
                  missing=needs.missing)
    rows = []

    def arm_evals(ref: ArmRef, ev: EvalSpec) -> list[EvalRun]:
        return [e for e in (needs.eval(r, ev) for r in needs.train(ref)) if e]

    def pair(a: str, b: str, ev: EvalSpec, evals: list[list[EvalRun]], fixed_b: bool = False) -> None:
        if not evals[0] or not evals[1]:
            return
        rates = [[e.task_rates for e in arm] for arm in evals]
        common = sorted(set.intersection(*(set(r) for arm in rates for r in arm)))
        if len(common) < 2:
            short = [e.path.name for arm in evals for e in arm if len(e.task_rates) < 2]
            table.notes.append(f"{a} vs {b} on {_eval_label(ev)}: fewer than two tasks with per-task records "
                               "(results.jsonl) in both" + (f"; {', '.join(short)} holds fewer than two" if short
                                                            else ""))
            return
        c = compare(*([[r[t] for t in common] for r in arm] for arm in rates), fixed_b=fixed_b)
        rows.append({"a": a, "b": b, "fixed_b": fixed_b, "dataset": ev.dataset, "samples": ev.samples,
                     "tasks": c.tasks, "seeds_a": c.seeds_a, "seeds_b": c.seeds_b, "diff": 100 * c.diff,
                     "ci_tasks_low": 100 * c.ci_tasks[0], "ci_tasks_high": 100 * c.ci_tasks[1],
                     "ci_tasks_seeds_low": 100 * c.ci_tasks_seeds[0], "ci_tasks_seeds_high": 100 * c.ci_tasks_seeds[1],
                     "a_ahead": c.a_ahead, "b_ahead": c.b_ahead, "mde": 100 * c.mde,
                     **{f"var_{k}": v for k, v in asdict(c.components).items()},
                     "seeds_for_target": None if fixed_b or min(c.seeds_a, c.seeds_b) < 2 else
                     seeds_needed(c.components, PLAN_TASKS, TARGET_POINTS / 100)})

    for ev in (_primary(spec, runs), _primary(spec, runs, sampled=True)):
        if ev is None:
            continue
        for a, b in _pairs(runs, spec):
            pair(_label(a), _label(b), ev, [arm_evals(a, ev), arm_evals(b, ev)])
        for label, base in base_evals(runs, needs, ev).items():   # what RL gained over the starting model
            for ref in main_arms(runs, spec)[0]:
                pair(_label(ref), label, ev, [arm_evals(ref, ev), [base]], fixed_b=True)
    if not rows:
        return table
    data = pd.DataFrame(rows)
    if ((data.seeds_a < 2) | ((data.seeds_b < 2) & ~data.fixed_b)).any():
        table.notes.append("an arm with one seed: its seed-to-seed variance is not estimated (it counts as 0), so its "
                           "rows' intervals are over tasks alone and their seed counts are blank; two seeds per arm "
                           "estimate it")
    ci = lambda lo, hi: f"[{lo:+.1f}, {hi:+.1f}]"  # noqa: E731
    table.data = data
    table.display = pd.DataFrame({
        "A - B": [f"{r.a} - {r.b}" for r in data.itertuples()],
        "Evaluation": [f"{r.dataset} ({'greedy' if r.samples == 1 else f'{r.samples} samples'}), {r.tasks} tasks, "
                       f"{r.seeds_a} x {'one fixed model' if r.fixed_b else f'{r.seeds_b} seeds'}"
                       for r in data.itertuples()],
        "Δ": [f"{x:+.1f}" for x in data["diff"]],
        "95 % CI, tasks": [ci(r.ci_tasks_low, r.ci_tasks_high) for r in data.itertuples()],
        "95 % CI, tasks x seeds": [ci(r.ci_tasks_seeds_low, r.ci_tasks_seeds_high) for r in data.itertuples()],
        "Tasks A / B ahead": [f"{r.a_ahead} / {r.b_ahead}" for r in data.itertuples()],
        f"Resolves ({power} % power)": [f"{x:.1f}" for x in data["mde"]],
        f"Seeds for {TARGET_POINTS:g} points on {PLAN_TASKS} tasks": [
            DASH if pd.isna(x) else f"{int(x)}" for x in data["seeds_for_target"]]})
    return table


def _final_greedy(runs: Runs, needs: Needs, refs: list[ArmRef], ev: EvalSpec | None) -> dict[str, list[EvalRun]]:
    out = {}
    for ref in refs:
        found = [e for e in (needs.eval(r, ev) for r in needs.train(ref)) if e] if ev else []
        if found:
            out[_label(ref)] = found
    return out


def error_tables(runs: Runs) -> tuple[Table, Table]:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    ev = _primary(spec, runs)
    found = _final_greedy(runs, needs, arms, ev)
    shares = Table("errors", "Error modes among failures (%)",
                   "Error-mode distribution among failed samples of each method's final model (conditional shares, % "
                   "of failures; the verifier's deterministic post-hoc classifier), means over seeds.",
                   missing=needs.missing)
    rates = Table("errors_absolute", "Absolute error-mode rates (%)",
                  "Error-mode rates over all scored samples (%), means over seeds: a failure share times the failure "
                  "rate.",
                  missing=needs.missing)
    records = [{"arm": arm, "seed": e.seed, "mode": mode,
                "share": pct(e.summary["error_modes"].get(mode, {}).get("share", 0.0)),
                "rate": pct(e.summary["error_modes"].get(mode, {}).get("rate", 0.0)),
                "count": e.summary["error_modes"].get(mode, {}).get("count", 0)}
               for arm, evs in found.items() for e in evs for mode in ERROR_MODES]
    if not records:
        return shares, rates
    data = pd.DataFrame(records)
    for table, col, digits in ((shares, "share", 1), (rates, "rate", 2)):
        wide = data.groupby(["arm", "mode"], sort=False)[col].mean().unstack("mode").reindex(columns=list(ERROR_MODES))
        table.data = data
        table.display = pd.DataFrame({"Method": wide.index, **{ERROR_MODES[m]: [f"{x:.{digits}f}" for x in wide[m]]
                                                                for m in ERROR_MODES}})
    return shares, rates


def per_repo_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    ev = _primary(spec, runs)
    found = _final_greedy(runs, needs, arms, ev)
    table = Table("per_repo", "Per-repository pass@1 (%)",
                  f"Pass@1 (%) per repository of {ev.dataset if ev else 'the eval set'}, means over seeds [95 % Wilson "
                  "interval over the repository's instances].",
                  missing=needs.missing)
    records = [{"arm": arm, "seed": e.seed, "repo": repo, "instances": v["instances"], "pass_at_1": pct(v["pass_at_1"])}
               for arm, evs in found.items() for e in evs for repo, v in e.summary["per_repo"].items()]
    if not records:
        return table
    data = pd.DataFrame(records)
    wide = data.groupby(["repo", "arm"], sort=False)["pass_at_1"].mean().unstack("arm").reindex(columns=list(found))
    inst = data.groupby("repo")["instances"].max()
    table.display = pd.DataFrame({"Repository": wide.index, "Instances": [int(inst[r]) for r in wide.index],
                                  **{a: [with_ci(f"{x:.1f}", _wilson_pct(x, inst[r])) for r, x in wide[a].items()]
                                     for a in wide.columns}})
    table.data = data
    return table


def _invalid(action: str) -> bool:
    try:
        parse_tool_call(action)
        return False
    except ToolCallError:
        return True


def fork_composition_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    _, crr = main_arms(runs, spec)
    table = Table("fork_composition", "Composition of logged counterfactual forks",
                  "Every logged fork of the CRR runs (tuples/) by its alternative: immediately invalid (fails the tool "
                  "call's syntax/schema check), valid with a failing branch, valid with a succeeding branch. Frequency "
                  "(%), mean contrast R(tau) - R(tilde tau), and the class-mean plug-in share p_c|mean_c| / sum_j "
                  "p_j|mean_j| (%); branches lost to infrastructure errors are left out.", missing=needs.missing)
    frames = [read_tuples(r.path) for r in (needs.train(crr) if crr else [])]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    df = df.dropna(subset=["reward", "cf_reward"]) if not df.empty else df
    if df.empty:
        return table
    df["class"] = np.where([_invalid(a) for a in df.counterfactual_action], "Immediately invalid",
                           np.where(df.cf_reward > 0, "Valid, branch succeeds", "Valid, branch fails"))
    df["contrast"] = df.reward - df.cf_reward
    g = df.groupby("class").agg(forks=("contrast", "size"), mean_contrast=("contrast", "mean"))
    g = g.reindex(["Immediately invalid", "Valid, branch fails", "Valid, branch succeeds"]).fillna({"forks": 0})
    g["frequency"] = 100 * g.forks / g.forks.sum()
    weight = g.frequency * g.mean_contrast.abs()
    g["plugin_share"] = 100 * weight / weight.sum() if weight.sum() > 0 else math.nan
    table.data = g.reset_index()
    table.display = pd.DataFrame({"Alternative class": g.index, "Forks": g.forks.astype(int),
                                  "Fork frequency (%)": [pm(x) for x in g.frequency],
                                  "Mean contrast": [DASH if math.isnan(x) else f"{x:+.2f}" for x in g.mean_contrast],
                                  "Plug-in share (%)": [pm(x) for x in g.plugin_share]})
    return table


def _step_credit(run: TrainRun) -> dict | None:
    """Counts over one run's on-policy steps (its trajectory records) of how its step advantage A_t relates to
    GRPO's on the same step, and its scored forks' outcome pairs (R(tau), R(tilde tau)); None: no records."""
    steps = [s for r in read_records(run.path) if r["kind"] == "trajectory" for s in r["steps"]
             if s.get("advantage") is not None and s.get("grpo_advantage") is not None]
    if not steps:
        return None
    a, g = np.array([s["advantage"] for s in steps]), np.array([s["grpo_advantage"] for s in steps])
    differs = ~np.isclose(a, g, rtol=0.0, atol=1e-9)
    zero_a, zero_g = np.isclose(a, 0.0, atol=1e-9), np.isclose(g, 0.0, atol=1e-9)
    pairs = {k: sum((m.get("outcome_pairs") or {}).get(k, 0) for m in run.metrics.values())
             for k in ("1-0", "0-1", "1-1", "0-0")}
    return {"steps": len(steps), "selected": sum(bool(s.get("selected")) for s in steps),
            "differs": int(differs.sum()), "opposite_sign": int((a * g < 0).sum()),
            "zeroed": int((differs & zero_a & ~zero_g).sum()), "from_zero": int((differs & zero_g & ~zero_a).sum()),
            **{f"pairs_{k}": v for k, v in pairs.items()}}


def step_credit_table(runs: Runs) -> Table:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, _ = main_arms(runs, spec)
    table = Table("step_credit", "Step advantages in training against GRPO's",
                  "Every on-policy step of each arm's training runs (their trajectory records, seeds pooled): the "
                  "share the selector picked, the share whose advantage A_t differs from GRPO's on the same step "
                  "(R - mean of the group), of opposite sign, set to 0 where GRPO's is not, and made non-zero where "
                  "GRPO's is 0 (an all-fail or all-solve group); and the scored forks by outcome pair "
                  "R(tau)-R(tilde tau) (1-0: the realised step did better than its alternative). With a binary "
                  "reward a counterfactual contrast cannot oppose GRPO's sign (R = 1 makes both >= 0, R = 0 both "
                  "<= 0): CRR can only zero GRPO's advantage (1-1, 0-0), enlarge it, or give one where GRPO's is 0.",
                  missing=needs.missing)
    rows = []
    for ref in arms:
        found = [(r, _step_credit(r)) for r in needs.train(ref)]
        if any(c is None for _, c in found):
            table.notes.append(f"{_label(ref)}: {sum(c is None for _, c in found)} run(s) kept no trajectory records "
                               "(keep_trajectories)")
        counts = [c for _, c in found if c is not None]
        if counts:
            rows.append({"arm": _label(ref), "seeds": len(counts), **{k: sum(c[k] for c in counts) for k in counts[0]}})
    if not rows:
        return table
    data = pd.DataFrame(rows)
    share = lambda col: [f"{100 * x / n:.1f}" for x, n in zip(data[col], data.steps)]  # noqa: E731
    table.data = data
    table.display = pd.DataFrame({
        "Method": data.arm, "Seeds": data.seeds, "Steps": data.steps, "Selected (%)": share("selected"),
        "≠ GRPO (%)": share("differs"), "Opposite sign (%)": share("opposite_sign"), "Zeroed (%)": share("zeroed"),
        "From zero (%)": share("from_zero"),
        "Fork pairs 1-0 / 0-1 / 1-1 / 0-0": [f"{r['pairs_1-0']} / {r['pairs_0-1']} / "
                                              f"{r['pairs_1-1']} / {r['pairs_0-0']}"
                                             for _, r in data.iterrows()]})
    return table


def all_tables(runs: Runs) -> list[Table]:
    errors, errors_absolute = error_tables(runs)
    makers: list[Callable[[], Table]] = [
        lambda: main_table(runs), lambda: composition_table(runs), lambda: search_select_table(runs),
        lambda: accounting_table(runs), lambda: wallclock_table(runs),
        *[(lambda f=f: ablation_table(runs, f)) for f in FACTORS],
        lambda: paired_table(runs), lambda: snr_table(runs), lambda: covariance_table(runs), lambda: passk_table(runs),
        lambda: errors, lambda: errors_absolute, lambda: per_repo_table(runs), lambda: fork_composition_table(runs),
        lambda: step_credit_table(runs)]
    return [make() for make in makers]
