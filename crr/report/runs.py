"""Find and load the run directories a report is made from: `crr train` runs (config, ledger, iteration
metrics, summary) and `crr eval` runs (config, summary), each train run assigned to an arm of the shipped
comparison specs and each eval run linked to the train run and checkpoint it evaluated.

An arm is what the seeds of one configuration share: the method, the values of the ablation keys (GRPO
ignores them) and the budget (a fixed `budget_hours`, or "matched" for the equal-wall-clock arm whose budget
is another run's measured wall clock). A run that no comparison spec names gets an arm of its own, labelled
by what differs from the CRR preset of its scale (e.g. "crr k=3").
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pandas as pd

from crr.errors import CRRError
from crr.eval.passk import instance_counts
from crr.experiments import ABLATION_KEYS, EXPERIMENTS, Arm, Comparison, comparisons, read_preset
from crr.rundir import read_jsonl, read_run_mapping

log = logging.getLogger(__name__)

MATCHED = "matched"
# What an evaluation measures (not how it runs): one made with other values of these answers another question.
MEASURED = ("n_tasks", "max_turns", "max_new_tokens", "temperature", "seed", "split")


def arm_key(settings: dict, defaults: dict, matched_budget: bool = False) -> tuple:
    """(method, ablation values, budget): the ablation keys the CRR preset lists, unset ones at its values."""
    method = settings.get("method", "crr")
    ablations = () if method == "grpo" else tuple((k, settings.get(k, defaults[k])) for k in ABLATION_KEYS
                                                  if k in defaults)
    return method, ablations, MATCHED if matched_budget else settings.get("budget_hours")


@dataclass
class ArmRef:
    key: tuple
    label: str
    arm: Arm | None = None          # the spec arm (its commands); None for a run no spec names

    @property
    def method(self) -> str:
        return self.key[0]

    def differs_only_in(self, other: ArmRef, factors: set[str]) -> bool:
        """Same method and budget, ablation values equal except in `factors` (and different there)."""
        if self.key[0] != other.key[0] or self.key[2] != other.key[2] or self.key == other.key:
            return False
        mine, theirs = dict(self.key[1]), dict(other.key[1])
        return all(mine[k] == theirs[k] for k in mine if k not in factors)

    def value(self, name: str):
        return dict(self.key[1]).get(name)


class Catalogue:
    """The arms of one scale's comparison specs, by key; or of one given comparison (`main`), which the tables
    then follow alone (its arms, seeds and evaluations: `crr report --spec`, `crr experiment run`)."""

    def __init__(self, scale: str, main: Comparison | None = None):
        self.scale, self.main = scale, main
        preset = EXPERIMENTS / f"{scale}-crr.yaml"
        self.defaults = read_preset(preset) if preset.is_file() else {}
        self.specs: dict[str, Comparison] = {main.name: main} if main else {c.name: c for c in comparisons(scale)}
        self.arms: dict[tuple, ArmRef] = {}
        for spec in self.specs.values():
            for arm in spec.arms.values():
                key = arm_key(arm.settings, self.defaults, arm.budget_from is not None)
                self.arms.setdefault(key, ArmRef(key, arm.name, arm))

    def spec(self, *names: str) -> Comparison | None:
        """The first of `names` (without the scale prefix) that this scale has; a given comparison is every one
        (its own main arms, ablation arms, Search-Select arm)."""
        if self.main is not None:
            return self.main
        return next((self.specs[f"{self.scale}-{n}"] for n in names if f"{self.scale}-{n}" in self.specs), None)

    def ref(self, spec: Comparison, arm_name: str) -> ArmRef:
        arm = spec.arms[arm_name]
        return self.arms[arm_key(arm.settings, self.defaults, arm.budget_from is not None)]

    def of_config(self, config: dict) -> ArmRef:
        key = arm_key(config, self.defaults)
        if key in self.arms:
            return self.arms[key]
        matched = arm_key(config, self.defaults, True)
        if config.get("budget_hours") is not None and matched in self.arms:
            return self.arms[matched]
        diffs = [f"{k}={v}" for k, v in key[1] if k in self.defaults and self.defaults[k] != v]
        budget = [] if key[2] is None else [f"budget {key[2]:g} h"]
        ref = self.arms[key] = ArmRef(key, " ".join([key[0], *diffs, *budget]))
        return ref


@dataclass
class TrainRun:
    path: Path
    config: dict
    iterations: list[dict]          # ledger.json iterations (authoritative after a resume)
    metrics: dict[int, dict]        # step (1-based) -> the last `iteration` record logged for it
    summary: dict | None            # None: not finished (interrupted or still running)
    arm: ArmRef

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def complete(self) -> bool:
        return self.summary is not None

    @property
    def updates(self) -> int:
        return len(self.iterations)

    @property
    def wall_s(self) -> float:
        return float(sum(it["wall_s"] for it in self.iterations))

    @property
    def window_s(self) -> float:
        """The training window checkpoints are placed in: an equal-wall-clock run's budget (its source run's
        wall clock), else the run's own ledger wall clock."""
        budget = self.config.get("budget_hours")
        return budget * 3600 if budget is not None and self.arm.key[2] == MATCHED else self.wall_s

    def eval_steps(self, fractions: tuple[float, ...]) -> list[int]:
        """The final update and the saved checkpoints nearest these fractions of the window (what `crr
        experiment run` evaluates and the sample-efficiency curves ask for)."""
        steps = {self.step_at(f * self.window_s) for f in (*fractions, 1.0)} if fractions else set()
        return sorted(s for s in steps | {self.updates} if s)

    def cumulative(self, step: int) -> dict:
        """The running ledger totals after update `step` (1-based)."""
        return {k: sum(it[k] for it in self.iterations[:step]) for k in self.iterations[0] if k != "iteration"}

    def saved_steps(self) -> list[int]:
        """Updates whose weights can be evaluated: the checkpoints on disk and, when finished, the final model."""
        folder = self.path / "checkpoints"
        names = (re.fullmatch(r"checkpoint-(\d+)", p.name) for p in folder.iterdir()) if folder.is_dir() else ()
        steps = {int(m.group(1)) for m in names if m}
        if self.complete:
            steps.add(self.updates)
        return sorted(s for s in steps if 0 < s <= self.updates)

    def step_at(self, seconds: float) -> int | None:
        """The saved update whose cumulative ledger wall clock is closest to `seconds` (an observed
        checkpoint, not an interpolation)."""
        steps = self.saved_steps()
        if not steps:
            return None
        cum = list(pd.Series([it["wall_s"] for it in self.iterations]).cumsum())
        return min(steps, key=lambda s: (abs(cum[s - 1] - seconds), s))

    def frame(self) -> pd.DataFrame:
        """One row per update: the ledger iteration, its running totals and the iteration metrics."""
        df = pd.DataFrame(self.iterations)
        if df.empty:
            return df
        df = df.sort_values("iteration").reset_index(drop=True)
        df["step"] = df["iteration"] + 1
        for col in ("wall_s", "trajectories", "updates", "generated_tokens_on_policy", "generated_tokens_all",
                    "effective_tokens", "forks"):
            df[f"cum_{col}"] = df[col].cumsum()
        # float columns: a diagnostic not recorded at an update (None) is NaN, so means and plots skip it
        for name in ("reward_mean", "advantage_snr", "fork_share", "replaced", "selector_hits", "contrasts"):
            df[name] = pd.Series([self.metrics.get(s, {}).get(name) for s in df["step"]], dtype=float)
        cov = [self.metrics.get(s, {}).get("covariance") or {} for s in df["step"]]
        for name in ("cov", "cov_p5", "cov_p95", "pairs"):
            df[name] = pd.Series([c.get(name) for c in cov], dtype=float)
        df.insert(0, "seed", self.seed)
        df.insert(0, "arm", self.arm.label)
        df.insert(0, "run", str(self.path))
        return df


@dataclass
class EvalRun:
    path: Path
    config: dict
    summary: dict | None
    train: TrainRun | None
    step: int | None                # the update the evaluated weights come from (None: unknown or base model)

    @property
    def complete(self) -> bool:
        """crr eval writes a summary even when interrupted; it is complete when no sample is missing."""
        return self.summary is not None and not self.summary.get("missing")

    @property
    def dataset(self) -> str:
        return str(self.config.get("dataset"))

    def made_as(self, settings: dict) -> bool:
        """Whether this evaluation measured what `settings` (a comparison spec's eval entry) ask for."""
        return all(self.config.get(k) == v for k, v in settings.items() if k in MEASURED)

    @property
    def samples(self) -> int:
        return int(self.config.get("samples") or 1)

    @property
    def final(self) -> bool:
        return self.train is None or self.config.get("checkpoint") is None or self.step == self.train.updates

    @property
    def label(self) -> str:
        if self.train is not None:
            return self.train.arm.label
        if self.config.get("train_run") is None:
            return f"base policy ({Path(str(self.config.get('model'))).name})"
        return str(self.config.get("method") or "unknown")

    @property
    def seed(self) -> int | None:
        return self.train.seed if self.train else self.config.get("train_seed")

    @cached_property
    def task_counts(self) -> dict[str, tuple[int, int]]:
        """instance_id -> (scored samples, passing) from results.jsonl (the latest record of each sample, as the
        summary counts them); empty when the run has no per-task records."""
        latest = {(r["instance_id"], r["sample"]): r for r in read_jsonl(self.path / "results.jsonl")}
        return instance_counts(r for (_, sample), r in latest.items() if sample < self.samples)

    @property
    def task_rates(self) -> dict[str, float]:
        """instance_id -> the share of its scored samples that pass (1 or 0 greedy): what a paired comparison pairs."""
        return {iid: c / n for iid, (n, c) in self.task_counts.items()}


@dataclass
class Runs:
    train: list[TrainRun]
    evals: list[EvalRun]
    catalogue: Catalogue
    ignored: list[str] = field(default_factory=list)

    @property
    def scale(self) -> str:
        return self.catalogue.scale

    def of_arm(self, ref: ArmRef, *, complete: bool = True) -> list[TrainRun]:
        return sorted((r for r in self.train if r.arm.key == ref.key and (r.complete or not complete)),
                      key=lambda r: r.seed)

    def evals_of(self, run: TrainRun, dataset: str, *, samples: int | None = 1, step: int | None = None,
                 settings: dict | None = None) -> EvalRun | None:
        """The latest complete eval of `run` on `dataset` (of its final weights unless `step` is given), one made as
        `settings` say first (EvalRun.made_as); samples=None: any sample count > 1 (a pass@k evaluation)."""
        found = [e for e in self.evals if e.complete and e.train is run and e.dataset == dataset
                 and (e.samples == samples if samples is not None else e.samples > 1)
                 and (e.final if step is None else e.step == step)]
        return max(found, key=lambda e: (e.made_as(settings or {}), e.path.name)) if found else None


def discover(paths: list[Path]) -> list[Path]:
    """Every run directory (one holding manifest.json) at or under `paths`."""
    if not paths:
        raise CRRError("give at least one --runs DIR (a run directory or a folder of them)")
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise CRRError(f"--runs {path} does not exist")
        if not path.is_dir():
            raise CRRError(f"--runs {path} is a file; pass a run directory or a folder holding run directories")
        if (path / "manifest.json").is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.rglob("manifest.json"))
        if not below:
            raise CRRError(f"--runs {path} holds no crr run directories (no manifest.json at or under it); "
                           "pass directories made by `crr train` or `crr eval`, or a folder of them")
        found += below
    return sorted({p.resolve() for p in found})


def _scale(config: dict) -> str:
    return "cpu" if config.get("use_cpu") else "paper"


def _json(path: Path) -> dict | None:
    """A run file's JSON mapping, None when absent; a corrupt one is named (the writers are atomic, so it was
    edited)."""
    return read_run_mapping(path) if path.is_file() else None


def _load_train(path: Path, config: dict, catalogue: Catalogue) -> TrainRun:
    iterations = sorted((_json(path / "ledger.json") or {"iterations": []})["iterations"],
                        key=lambda it: it["iteration"])
    metrics = {int(r["step"]): r for r in read_jsonl(path / "metrics.jsonl") if r.get("event") == "iteration"}
    summary = _json(path / "summary.json")
    return TrainRun(path, config, iterations, metrics, summary, catalogue.of_config(config))


def _checkpoint_step(checkpoint: str | None) -> int | None:
    match = re.search(r"checkpoint-(\d+)/?$", str(checkpoint)) if checkpoint else None
    return int(match.group(1)) if match else None


def load_runs(paths: list[Path], *, require: bool = True, spec: Comparison | None = None) -> Runs:
    """Every train and eval run at or under `paths`; other runs (sft, rollout, filter, credit-audit) are listed
    as ignored. None at all is a CRRError unless not `require`d (the paths hold credit audits). `spec`: the
    comparison the runs belong to (default: the shipped specs of their scale)."""
    dirs = discover(paths)
    raw: list[tuple[Path, str, dict]] = []
    ignored = []
    for path in dirs:
        command = (_json(path / "manifest.json") or {}).get("command")
        config = read_run_mapping(path / "config.yaml", "YAML") if (path / "config.yaml").is_file() else {}
        if command in ("train", "eval"):
            raw.append((path, command, config))
        else:
            ignored.append(f"{path} ({command} run)")
    if not raw and require:
        raise CRRError(f"no `crr train` or `crr eval` runs among {len(dirs)} run "
                       f"director{'y' if len(dirs) == 1 else 'ies'} "
                       f"under {', '.join(map(str, paths))}; make them with `crr train` and `crr eval`")
    scales = {_scale(c) for _, cmd, c in raw if cmd == "train"}
    if len(scales) > 1:
        raise CRRError("--runs mixes CPU-scale and paper-scale train runs; report each scale separately")
    if spec is not None:
        spec_scale = _scale(next(iter(spec.arms.values())).settings)
        if scales - {spec_scale}:
            raise CRRError(f"{spec.path.name} is a {spec_scale}-scale comparison and --runs holds {scales.pop()}-scale "
                           "train runs; pass the spec they were made with")
        scales = {spec_scale}
    catalogue = Catalogue(scales.pop() if scales else "cpu", spec)
    train = [_load_train(p, c, catalogue) for p, cmd, c in raw if cmd == "train"]
    seen: dict[tuple, TrainRun] = {}
    for r in train:   # a seed's later run supersedes an earlier one, unless they are runs of two comparisons
        other = seen.setdefault((r.arm.key, r.seed), r)
        if any(other.config.get(k) != r.config.get(k) for k in ("tasks", "model")):
            raise CRRError(f"{other.path} and {r.path} are seed {r.seed} of one arm ({r.arm.label}) trained on "
                           "different tasks or models: runs of two comparisons; report each comparison's runs apart")
    by_path = {r.path: r for r in train}
    by_name = {r.path.name: r for r in train}
    evals = []
    for path, cmd, config in raw:
        if cmd != "eval":
            continue
        summary = _json(path / "summary.json")
        linked = None
        if config.get("train_run"):
            target = Path(config["train_run"])
            # moved or copied result folders keep run names but not absolute paths
            linked = by_path.get(target.resolve()) or by_name.get(target.name)
            if linked is None:
                log.warning("%s evaluates %s, which is not among --runs", path, target)
        step = _checkpoint_step(config.get("checkpoint"))
        if linked is not None and step is None:
            step = linked.updates
        evals.append(EvalRun(path, config, summary, linked, step))
    return Runs(train, evals, catalogue, ignored)
