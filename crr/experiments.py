"""Experiment presets and comparison specs (the files in experiments/). Plain YAML, no torch or TRL, so that
`crr report` reads them quickly.

A preset is a flat mapping of config keys; `base: other.yaml` (relative to the preset's folder) starts from
another preset, so an arm is a base preset plus the keys it changes:

    # experiments/cpu-grpo.yaml
    base: cpu-crr.yaml
    method: grpo

A comparison spec (`*.comparison.yaml`) lists the arms of one paper experiment, the seeds, and the
evaluations of every arm's final model; `crr experiment run SPEC` runs it (crr.comparison) and `crr report`
takes from it which runs a table needs and the commands that make them:

    name: cpu-main
    seeds: [11, 23, 47]
    base: true                                        # evaluate the model every arm starts from, too
    eval:                                             # `crr eval DATASET` (or `crr eval tasks FILE`) settings
      - {dataset: micro-test, checkpoint_fractions: [0.25, 0.5, 0.75]}
      - {dataset: micro-test, samples: 8, temperature: 0.6, arms: [grpo, crr]}
    arms:
      grpo: {config: cpu-grpo.yaml}
      crr: {config: cpu-crr.yaml}
      k=1: {config: cpu-crr.yaml, overrides: [k=1], seeds: [11]}
      grpo-equal-wall-clock: {config: cpu-grpo-wallclock.yaml, budget_from: crr}

`budget_from: ARM` gives the arm `--budget-hours` = the measured ledger wall clock of ARM's run of the same
seed (the equal-wall-clock comparison, Table supp-wallclock). `checkpoint_fractions` also evaluates the saved
checkpoints nearest those fractions of each run's wall clock (the sample-efficiency curves). `base: true`
evaluates the arms' common starting model with every eval entry's settings (`crr eval DATASET --model M`), so
that the report can pair each arm with it: what RL gained, with its interval.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crr.errors import CRRError
from crr.sandbox import engine_spec_of
from crr.tasks.loaders import TASK_SETS

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
PAPER_SEEDS = (11, 23, 47)
# The config keys the paper's ablations and controls vary: train runs with the same method, the same values
# of these keys and the same budget are seeds of one arm (crr.report.runs; a key counts once the scale's CRR
# preset lists it, so a run made before a key existed still finds its arm).
ABLATION_KEYS = ("k", "selector", "horizon", "cf_temperature", "zero_contrast", "cf_samples", "proposal",
                 "fork_cost_multiplier", "replay_noise")
EVAL_SETTINGS = ("samples", "temperature", "seed", "n_tasks", "max_turns", "max_new_tokens", "split", "engine",
                 "engine_options", "ray", "mode", "workers", "batch")  # crr.eval.EvalConfig fields a spec may set


# a number in exponent notation, which PyYAML (YAML 1.1) reads as a string unless it has a dot: 2e-3
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def read_yaml(path: Path | str) -> Any:
    """A YAML file a person wrote (a preset, a comparison spec, an SFT recipe); not valid YAML, a CRRError naming the
    file and where the parser stopped."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise CRRError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


def override(pair: str, example: str) -> tuple[str, Any]:
    """A `key=value` override of a preset: the value read as the same key in the file would be (2 an int, true a
    bool, [1, 2] a list), and 2e-3 as the float it is; no `=`, or a value that is not YAML, a CRRError naming the
    pair (`example`: the form to show)."""
    key, sep, value = pair.partition("=")
    if not sep:
        raise CRRError(f"override {pair!r} is not key=value (e.g. {example})")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise CRRError(f"override {pair!r}: the value is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    return key, float(parsed) if isinstance(parsed, str) and _EXPONENT.fullmatch(parsed) else parsed


def read_preset(path: Path | str, _seen: tuple[Path, ...] = ()) -> dict:
    """A preset's keys with its `base:` chain applied (the preset's own keys win)."""
    path = Path(path).resolve()
    if path in _seen:
        raise CRRError(f"preset base chain loops: {' -> '.join(p.name for p in (*_seen, path))}")
    if not path.is_file():
        raise CRRError(f"no config file at {path}; the presets are in {EXPERIMENTS}")
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise CRRError(f"{path} must be a YAML mapping of config keys")
    base = data.pop("base", None)
    if base is None:
        return data
    return {**read_preset(path.parent / base, (*_seen, path)), **data}


def _join(args: list[str]) -> str:
    """A command line for display; <placeholders> stay unquoted."""
    return " ".join(a if a.startswith("<") else shlex.quote(a) for a in args)


def display_path(path: Path) -> str:
    """A preset or task path as typed from the repository root, when it lies inside it."""
    try:
        return str(path.relative_to(EXPERIMENTS.parent))
    except ValueError:
        return str(path)


@dataclass
class Arm:
    name: str
    config: Path                        # the preset file
    overrides: list[str] = field(default_factory=list)
    seeds: tuple[int, ...] = PAPER_SEEDS
    budget_from: str | None = None

    @property
    def settings(self) -> dict:
        """The preset with the overrides applied."""
        out = read_preset(self.config)
        for pair in self.overrides:
            key, value = override(pair, "k=2")
            out[key.removeprefix("crr.").removeprefix("trl.")] = value
        return out

    def train_args(self, seed: int, budget_hours: float | None = None, out: Path | None = None) -> list[str]:
        """`crr train` arguments (without the program name) for one seed."""
        args = ["train", "--config", display_path(self.config), "--seed", str(seed)]
        if self.budget_from is not None:
            args += ["--budget-hours", f"{budget_hours:.6g}" if budget_hours is not None
                     else f"<wall-clock hours of the {self.budget_from} run of seed {seed}>"]
        if out is not None:
            args += ["--out", str(out)]
        return args + self.overrides

    def train_command(self, seed: int, budget_hours: float | None = None, out: Path | None = None) -> str:
        return _join(["crr", *self.train_args(seed, budget_hours, out)])


@dataclass
class EvalSpec:
    """One evaluation of every arm's final model (and of the checkpoints nearest these fractions)."""
    dataset: str = "micro-test"         # a benchmark name, or a task file's label (`tasks: FILE`)
    tasks: Path | None = None
    checkpoint_fractions: tuple[float, ...] = ()
    settings: dict = field(default_factory=dict)
    arms: tuple[str, ...] = ()          # only these arms (empty: every arm)

    def covers(self, arm: str) -> bool:
        return not self.arms or arm in self.arms

    @property
    def samples(self) -> int:
        return int(self.settings.get("samples", 1))

    def eval_args(self, run: str | None, checkpoint: int | None = None, out: Path | str = "results/evals",
                  model: str | None = None) -> list[str]:
        """`crr eval` of a train run's weights, or with run None of `model` (None: the shipped default)."""
        source = ["--run", str(run)] if run is not None else ["--model", model] if model else []
        args = ["eval", *(["tasks", display_path(self.tasks)] if self.tasks else [self.dataset]), *source]
        if checkpoint is not None:
            args += ["--checkpoint", str(checkpoint)]
        for key, value in self.settings.items():
            if key == "engine_options":   # the engine spec's options, as `crr eval --engine-opt KEY=VALUE`
                args += [a for k, v in value.items() for a in ("--engine-opt", f"{k}={v}")]
            else:
                args += [f"--{key.replace('_', '-')}", str(value)]
        return args + ["--out", str(out)]

    def command(self, run: str | None, checkpoint: int | None = None, out: Path | str = "results/evals",
                model: str | None = None) -> str:
        return _join(["crr", *self.eval_args(run, checkpoint, out, model)])


@dataclass
class Comparison:
    name: str
    path: Path
    arms: dict[str, Arm]
    seeds: tuple[int, ...]
    evals: list[EvalSpec]
    base: bool = False                  # also evaluate the arms' starting model (base_model) on every entry

    @property
    def base_model(self) -> str | None:
        """The model every arm starts from (its preset's `model`; None: the shipped default policy)."""
        return next(iter(self.arms.values())).settings.get("model")

    @property
    def base_evals(self) -> list[EvalSpec]:
        """The evaluations of the base model: one per dataset and sample count (checkpoints and arms do not apply)."""
        out: dict[tuple[str, int], EvalSpec] = {}
        for e in self.evals if self.base else ():
            out.setdefault((e.dataset, e.samples), e)
        return list(out.values())


def _eval_spec(path: Path, entry) -> EvalSpec:
    if not isinstance(entry, dict):
        raise CRRError(f"{path}: an eval entry is a mapping like {{dataset: micro-test}}, got {entry!r}")
    bad = sorted(set(entry) - {"dataset", "tasks", "checkpoint_fractions", "arms", *EVAL_SETTINGS})
    if bad:
        raise CRRError(f"{path}: unknown eval key(s) {bad}; use dataset or tasks, checkpoint_fractions, arms and "
                       f"{', '.join(EVAL_SETTINGS)}")
    arms = tuple(str(a) for a in entry.get("arms", ()))
    fractions = tuple(float(f) for f in entry.get("checkpoint_fractions", ()))
    if not all(0 < f < 1 for f in fractions):
        raise CRRError(f"{path}: checkpoint_fractions lie in (0, 1) (the final model is always evaluated)")
    settings = {k: entry[k] for k in EVAL_SETTINGS if k in entry}
    engine_spec_of(settings)   # an option its engine does not take fails when the spec is read
    if "tasks" in entry:
        tasks = (path.parent / str(entry["tasks"])).resolve()
        # crr eval labels a task file's results by the file's stem (crr.eval.evaluate.benchmark)
        return EvalSpec(tasks.stem or tasks.name, tasks, fractions, settings, arms)
    dataset = entry.get("dataset", "micro-test")
    if dataset not in TASK_SETS:
        raise CRRError(f"{path}: eval dataset {dataset!r} is not one of {', '.join(TASK_SETS)} (or give tasks: FILE)")
    return EvalSpec(dataset, None, fractions, settings, arms)


def _seeds(value: Any, what: str) -> tuple[int, ...]:
    """A spec's list of seeds (integers; YAML reads `[11, 23]` so), else a CRRError naming `what`."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(s, int) and not isinstance(s, bool)
                                                                    for s in value):
        raise CRRError(f"{what} must be a list of integers, got {value!r}")
    return tuple(value)


def load_comparison(path: Path | str) -> Comparison:
    """A comparison spec, validated: every arm's preset exists and `budget_from` names another arm."""
    path = Path(path)
    if not path.is_file() and (EXPERIMENTS / path.name).is_file():
        path = EXPERIMENTS / path.name
    if not path.is_file():
        raise CRRError(f"no comparison spec at {path}; the shipped ones are {EXPERIMENTS}/*.comparison.yaml")
    data = read_yaml(path) or {}
    if not isinstance(data, dict) or not isinstance(data.get("arms"), dict) or not data["arms"]:
        raise CRRError(f"{path}: a comparison spec is a mapping with `arms:` (name: {{config: PRESET}})")
    unknown = sorted(set(data) - {"name", "seeds", "eval", "arms", "base"})
    if unknown:
        raise CRRError(f"{path}: unknown key(s) {unknown}; a spec has name, seeds, base, eval and arms")
    if not isinstance(data.get("base", False), bool):
        raise CRRError(f"{path}: base is true or false (evaluate the arms' starting model too), got {data['base']!r}")
    seeds = _seeds(data.get("seeds", PAPER_SEEDS), f"{path}: seeds")
    evals = [_eval_spec(path, e) for e in data.get("eval") or []]
    arms = {}
    for name, spec in data["arms"].items():
        spec = spec or {}
        if "config" not in spec:
            raise CRRError(f"{path}: arm {name!r} needs `config: PRESET.yaml`")
        bad = sorted(set(spec) - {"config", "overrides", "seeds", "budget_from"})
        if bad:
            raise CRRError(f"{path}: arm {name!r} has unknown key(s) {bad}; an arm has config, overrides, seeds, "
                           "budget_from")
        config = (path.parent / spec["config"]).resolve()
        read_preset(config)   # a missing or malformed preset fails now, not hours into the comparison
        overrides = [str(o) for o in spec.get("overrides", [])]
        if any("=" not in o for o in overrides):
            raise CRRError(f"{path}: arm {name!r}: overrides are key=value strings, got {overrides}")
        arms[name] = Arm(str(name), config, overrides, _seeds(spec.get("seeds", seeds), f"{path}: arm {name!r}: seeds"),
                         spec.get("budget_from"))
    for ev in evals:
        if set(ev.arms) - set(arms):
            raise CRRError(f"{path}: eval of {ev.dataset} names unknown arm(s) {sorted(set(ev.arms) - set(arms))}")
    for arm in arms.values():
        if arm.budget_from is not None and (arm.budget_from not in arms or arms[arm.budget_from].budget_from):
            raise CRRError(f"{path}: arm {arm.name!r} takes its budget from {arm.budget_from!r}, which is not an "
                           "arm with a budget of its own")
    name = data.get("name", path.name.removesuffix(".yaml").removesuffix(".comparison"))
    comparison = Comparison(str(name), path, arms, seeds, evals, bool(data.get("base", False)))
    models = sorted({str(a.settings.get("model")) for a in arms.values()}) if comparison.base else []
    if len(models) > 1:
        raise CRRError(f"{path}: base: true evaluates the model the arms start from, but its arms start from "
                       f"different models ({models})")
    return comparison


def comparisons(scale: str) -> list[Comparison]:
    """The shipped comparison specs of one scale (cpu or paper)."""
    return [load_comparison(p) for p in sorted(EXPERIMENTS.glob(f"{scale}-*.comparison.yaml"))]
