"""`crr credit audit`: the true step advantage by exhaustive forking, and how well each advantage estimator
tracks it (issue 29, section 2).

    cfg = load_audit_config("experiments/credit-audit-nano.yaml", {"continuations": 8})
    run = start_audit(cfg, "results/runs")           # or: cfg, run = resume_audit(path)
    audit(cfg, run)                                  # records.jsonl
    summary = write_audit(run)   # crr.report.credit: credit_audit.{md,csv,tex,png,pdf}, summary.json

For each task, G trajectories are sampled as in training (crr.rollout, the rollout temperature, snapshots of
every s_t). The oracle forks the state s_t of every step and plays M on-policy continuations of each (a_t
resampled from pi, then on policy to the end; crr.train.counterfactual.run_branches with the `on_policy`
proposal), so that V(s_t) is the mean of M verifier returns (Wilson interval) and, the environment being
deterministic, Q(s_t, a_t) = V(s_{t+1}) and A*(t) = V(s_{t+1}) - V(s_t), with V(s_T) = R(tau) (Newcombe
interval; crr.credit.stats).

Every estimator then scores the same trajectories through `crr.train.advantages.estimate`, each with its own
normal budget, never the oracle's forks. The budgets the configured estimators need are played and recorded
raw (R draws each); the estimators are applied to them when the table is made, so that one registered later
is scored from the same records by `crr report`:

    grpo           the rows' rewards and groups
    crr            the selector's picks (k) and K counterfactual branches of each (the `tempered` proposal)
    zero_contrast  the same picks, no forks
    crr[v], zero_contrast[v]
                   the same on the fork budget of variant v (`variants`: another selector, gate, k or K),
                   played on the same trajectories and scored against the same oracle
    gigpo          per-step state keys (the tree digest of s_t and what the agent has observed)
    mc_values      K on-policy continuations of every step
    (any other registered estimator: everything above)

The random draws (branches, continuations, a random selector) are repeated R times, so that each
estimator's variance is measured. One record per trajectory goes to records.jsonl as soon as its task is
done (append-only, fsynced); a rerun on the run directory skips the trajectories recorded already, so an
interrupted audit resumes.

Variants can be added to a recorded audit (`resume_audit(path, variants)`, `crr credit audit --resume RUN
variants=...`): each task's trajectories are sampled again with the audit's seed, must replay its records
step for step (else a CRRError: the policy or the code changed), and each new variant's R draws are played with
the seeds it would have had in the audit itself, into variants.jsonl; the oracle is not played again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import typing
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from crr.credit.stats import estimator_metrics, values
from crr.errors import CRRError
from crr.policy import DTYPES, check_model
from crr.experiments import override, read_preset
from crr.rundir import RunDir, read_jsonl, read_run_mapping
from crr.seeds import derive_seed
from crr.train.proposals import PROPOSALS
from crr.train.selectors import SELECTORS
from crr.train.values import RANGES, Range, check_value

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
VARIANTS = "variants.jsonl"   # the draws of variants added to a recorded audit: one record per (trajectory, variant)
TABLE = "credit_audit"
DEFAULT_ESTIMATORS = ["grpo", "crr", "zero_contrast", "gigpo", "mc_values"]
NEEDS = {"grpo": set(), "crr": {"selected", "counterfactuals"}, "zero_contrast": {"selected"},
         "gigpo": {"state_keys"}, "mc_values": {"continuations"}}
EVERYTHING = {"selected", "counterfactuals", "state_keys", "continuations"}
EXCLUDED = {"search_select", "resets"}        # train on rows other than the realised ones (swapped
#                                               sequences, restart rows): not a step advantage on the realised rows
BUDGET_KEYS = ("k", "cf_samples", "cf_temperature", "selector", "proposal", "eta", "lambda_type", "horizon")  # CRR's
VARIANT_ESTIMATORS = ("crr", "zero_contrast")   # scored on each variant's budget


@dataclass
class AuditConfig:
    """Every hyperparameter of an audit (experiments/credit-audit-nano.yaml)."""
    model: str | None = None             # None: crr's default policy (crr.policy.model.default_policy_dir)
    tasks: str = "nano-band"
    n_tasks: int = 8                     # the first N tasks; N x G trajectories
    group_size: int = 4                  # G siblings per task, as in training
    continuations: int = 16              # M: the oracle's on-policy continuations per step
    repeats: int = 3                     # R: each estimator's random draws, repeated
    seed: int = 11
    temperature: float = 0.6             # the rollout temperature (trajectories, continuations)
    max_turns: int | None = None         # H; None: the model's recorded turn cap, else 50
    max_new_tokens: int = 96
    agent_format: str | None = None      # None: the model's recorded format
    dtype: typing.Literal[DTYPES] = "auto"   # the weights: as saved (the shipped default's bf16), or float32 on a
    #                                           CPU that emulates bf16 (crr doctor); a seed's episodes differ by dtype
    episode_time_limit_s: float = 600.0
    engine: str = "local"                # the engine spec (crr.sandbox.engines): a name, its options, ray/mode sugar
    engine_options: dict = field(default_factory=dict)
    ray: str | None = None
    mode: str | None = None
    workers: int | None = None
    # scored: these and every other registered estimator (but search_select); the budgets played are what
    # these need, so that one registered later is scored from the records (crr report) without a rerun
    estimators: list[str] = field(default_factory=lambda: list(DEFAULT_ESTIMATORS))
    # each estimator's own budget
    k: int = 4                           # CRR's fork budget per trajectory (its selector's picks)
    cf_samples: int = 2                  # CRR's K counterfactuals per pick
    cf_temperature: float = 0.7          # T_cf
    selector: str = "entropy_type"
    proposal: str = "tempered"
    eta: float = 0.4
    lambda_type: float = 0.6
    horizon: int | None = None           # CRR's counterfactual horizon h in steps after a_t; None: to the end
    mc_samples: int = 2                  # mc_values' K continuations per step
    advantage_params: dict = field(default_factory=dict)   # estimator -> its keyword params (gigpo: {omega: 1.0})
    # further fork budgets, name -> overrides of the keys above in BUDGET_KEYS; each is played on the same
    # trajectories and scored as crr[name] and zero_contrast[name] against the same oracle
    variants: dict = field(default_factory=dict)
    bootstrap: int = 1000                # resamples of trajectories for the correlations' intervals

    def __post_init__(self) -> None:
        check_values({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        for name, over in self.variants.items():
            if not isinstance(over, dict) or set(over) - set(BUDGET_KEYS) or not re.fullmatch(r"[\w.=-]+", str(name)):
                raise CRRError(f"variant {name!r}: expected a name of letters, digits and ._=- mapping to some of "
                               f"{', '.join(BUDGET_KEYS)}, got {over!r}")
            check_values(over, f"variant {name!r}: ")
        for name, budget in budgets(self).items():
            for key, known in (("selector", SELECTORS), ("proposal", PROPOSALS)):
                if budget[key] not in known:
                    raise CRRError(f"{f'variant {name!r}: ' if name else ''}unknown {key} {budget[key]!r}; choose one "
                                   f"of {', '.join(known)}")


# Where the numbers of AuditConfig must lie: train's ranges (crr.train.values.RANGES), under train's name for
# the key where it has another, and at least 1 for the audit's own counts.
TRAIN_KEYS = {"group_size": "num_generations", "temperature": "rollout_temperature"}
COUNTS = ("continuations", "repeats", "mc_samples", "bootstrap")


def check_values(values: dict, where: str = "") -> None:
    """Each of `values` (AuditConfig keys) of its field's annotated type, a finite number where it is one and
    within train's range for the key, as train checks its config (crr.train.config.validate): a CRRError
    naming the first bad key (after `where`)."""
    hints = typing.get_type_hints(AuditConfig)
    for name, value in values.items():
        check_value(name, value, hints[name], Range(1) if name in COUNTS else RANGES.get(TRAIN_KEYS.get(name, name)),
                    where)


def check_estimators(cfg: AuditConfig) -> None:
    """Every configured estimator (and every one given advantage_params) registered in crr.train.advantages or
    a function named as module.path:function, taking its advantage_params, as train takes advantage_estimator:
    a CRRError before anything is played. A recorded audit's config is not checked so: an estimator no longer
    registered is left out of its table (estimator_names), not refused."""
    from crr.train.advantages import check   # deferred: torch

    for name in dict.fromkeys([*cfg.estimators, *cfg.advantage_params]):
        params = cfg.advantage_params.get(name, {})
        if not isinstance(params, dict):
            raise CRRError(f"advantage_params: {name}={params!r}: expected a mapping of keyword parameters")
        check(name, params)


def load_audit_config(preset: Path | str | None = None, overrides: dict | None = None) -> AuditConfig:
    data = read_preset(preset) if preset is not None else {}
    data.update(overrides or {})
    names = {f.name for f in dataclasses.fields(AuditConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise CRRError(f"unknown audit config key(s) {unknown}; see experiments/credit-audit-nano.yaml")
    cfg = audit_config(data)
    check_estimators(cfg)
    check_inputs(cfg)
    return cfg


def check_inputs(cfg: AuditConfig) -> None:
    """A new audit's agent format, engine, model directory and tasks, as train checks its own: a CRRError
    before its run directory is made (the tasks last: a named set is generated on its first use)."""
    from crr.agent.prompt import agent_format   # deferred: the engines and loaders
    from crr.sandbox import engine_spec_of
    from crr.tasks.loaders import load_tasks

    if cfg.agent_format is not None:
        agent_format(cfg.agent_format)
    engine_spec_of(cfg)
    if cfg.model is not None:
        check_model(cfg.model, f"model={cfg.model}", adapter=True)
    if not load_tasks(cfg.tasks)[:cfg.n_tasks]:
        raise CRRError(f"{cfg.tasks} holds no tasks")


def audit_config(data: dict) -> AuditConfig:
    """An AuditConfig from its keys; `group` (audits and presets before G was named `group_size`) is read as
    group_size."""
    if "group" in data:
        data = {**{k: v for k, v in data.items() if k != "group"}, "group_size": data["group"]}
    return AuditConfig(**data)


def audit_records(path: Path) -> list[dict]:
    """An audit's records (records.jsonl) with the draws of the variants added to it later (variants.jsonl)
    in place; `group` (records before the sibling index was named `sibling`) is read as sibling."""
    records = [{**{k: v for k, v in r.items() if k != "group"}, "sibling": r["group"]} if "group" in r else r
               for r in read_jsonl(path / RECORDS)]
    by_key = {(r["task_index"], r["sibling"]): r for r in records}
    for added in read_jsonl(path / VARIANTS) if (path / VARIANTS).is_file() else ():
        for d, part in zip(by_key[added["task_index"], added["sibling"]]["draws"], added["draws"]):
            d.setdefault("variants", {})[added["variant"]] = part
    return records


def parse_overrides(pairs: list[str]) -> dict:
    return dict(override(pair, "continuations=8") for pair in pairs)


def start_audit(cfg: AuditConfig, out: Path | str) -> RunDir:
    return RunDir.create("credit-audit", f"n{cfg.n_tasks}-g{cfg.group_size}-m{cfg.continuations}-seed{cfg.seed}",
                         root=out, config=dataclasses.asdict(cfg), seeds={"audit": cfg.seed})


def resume_audit(path: Path | str, variants: dict | None = None) -> tuple[AuditConfig, RunDir]:
    """The audit at `path`, to go on with; `variants` (name -> budget overrides) are added to the config
    returned, to be played on the trajectories it has recorded without replaying the oracle (`audit`, which
    writes them into the run's config once every record has them)."""
    run = RunDir.open(path)
    if run.manifest.get("command") != "credit-audit":
        raise CRRError(f"{path} is a `crr {run.manifest.get('command')}` run, not a credit audit; --resume takes a "
                       "directory made by crr credit audit")
    run.lock()
    cfg = audit_config(run.config)
    if variants is not None and not isinstance(variants, dict):
        raise CRRError(f"variants must map names to budget overrides (e.g. variants={{mv: {{selector: mid_value}}}}), "
                       f"got {variants!r}")
    if variants:
        clash = [n for n, over in variants.items() if n in cfg.variants and cfg.variants[n] != over]
        if clash:
            raise CRRError(f"variant(s) {', '.join(clash)} already in the audit with other settings; choose new names")
        cfg = dataclasses.replace(cfg, variants={**cfg.variants, **variants})
    return cfg, run


def budgets(cfg: AuditConfig) -> dict[str, dict]:
    """The fork budgets played, by variant: "" (the configured one) first, then each variant's."""
    base = {key: getattr(cfg, key) for key in BUDGET_KEYS}
    return {"": base, **{name: {**base, **over} for name, over in cfg.variants.items()}}


def variant_of(name: str) -> tuple[str, str]:
    """A scored row's (estimator, variant): "crr[v]" -> ("crr", "v"), "crr" -> ("crr", "")."""
    estimator, _, variant = name.partition("[")
    return estimator, variant.rstrip("]")


def needs(name: str) -> set[str]:
    """What of the audit's budgets an estimator's rows are filled with (one not known here: everything)."""
    return NEEDS.get(name, EVERYTHING)


def estimator_names(cfg: AuditConfig) -> list[str]:
    """The estimators scored: the configured ones and every other registered one (search_select aside), those
    registered now or named as module.path:function (a configured one that is neither now is named in the log),
    GRPO first."""
    from crr.train.advantages import ESTIMATORS, resolve

    def known(name: str) -> bool:
        try:
            return resolve(name) is not None
        except CRRError:
            return False

    wanted = list(dict.fromkeys(cfg.estimators + [n for n in ESTIMATORS if n not in EXCLUDED]))
    missing = [n for n in wanted if not known(n)]
    if missing:
        log.warning("estimators not registered in crr.train.advantages, left out: %s", missing)
    names = sorted((n for n in wanted if n not in missing), key=lambda n: n != "grpo")
    return names + [f"{n}[{v}]" for v in cfg.variants for n in VARIANT_ESTIMATORS if n in ESTIMATORS]


class _Forks:
    """Plays forked branches of a task's trajectories through the training machinery (run_branches: one
    batched generation per round, the tool calls in the worker pool) and counts their cost."""

    def __init__(self, run: RunDir, backend, engine, tokenizer, episode, pool):
        from crr.agent.verdicts import Verdicts

        self.run, self.backend, self.engine, self.tokenizer, self.episode, self.pool = (
            run, backend, engine, tokenizer, episode, pool)
        self.rollouts = 0   # trajectories and branches played
        # the oracle's verdicts by final state (crr.agent.verdicts): its M continuations of a state often end
        # alike; the estimators' draws play and test every branch, so their costs are a run's without the savings
        # (reuse_verdicts=false reuse_played=false)
        self.oracle_verdicts = Verdicts()

    def play(self, trajs, picks: dict, samples: int, proposal: str, temperature: float, seed: int,
             horizon: int | None = None, verdicts=None):
        """The branches (crr.train.counterfactual.Branch), their environment steps per row, and seconds."""
        from crr.train.counterfactual import run_branches
        from crr.train.ledger import Ledger

        ledger = Ledger(self.run, writer=False)   # run_branches charges its phases there; never saved
        ledger.begin(0)
        start = time.perf_counter()
        branches = run_branches(trajs, picks, cf_samples=samples, backend=self.backend, engine=self.engine,
                                tokenizer=self.tokenizer, episode=self.episode, proposal=proposal,
                                cf_temperature=temperature, seed=seed, horizon=horizon, pool=self.pool, ledger=ledger,
                                verdicts=verdicts)
        seconds = time.perf_counter() - start
        self.rollouts += sum(b.sample is not None for b in branches)
        steps = [0] * len(trajs)
        for b in branches:
            if b.sample is not None:
                steps[b.row] += len(b.traj.steps) - b.t if b.traj is not None else 1
        return branches, steps, seconds


def _returns(branches, trajs) -> list[dict[int, list[float | None]]]:
    out: list[dict[int, list[float | None]]] = [{} for _ in trajs]
    for b in branches:
        if b.sample is not None:
            out[b.row].setdefault(b.t, []).append(b.reward)
    return out


def _trajectories(cfg: AuditConfig, task, task_index: int, forks: _Forks):
    """The task's G trajectories, sampled as in training (the audit's seed: the same every time), with the
    rollout's result (release it) and seconds."""
    from crr.rollout import RolloutConfig, rollout

    start = time.perf_counter()
    result = rollout([task], forks.backend, forks.engine, forks.tokenizer,
                     RolloutConfig(group_size=cfg.group_size, seed=derive_seed(cfg.seed, task_index, 0),
                                   episode=forks.episode), pool=forks.pool)
    forks.rollouts += len(result.trajectories)
    return result, time.perf_counter() - start


def _budget_draw(cfg: AuditConfig, trajs, task_index: int, forks: _Forks, budget: dict, r: int, variant: str,
                 play: bool) -> tuple[dict, list, list[int], float]:
    """Repeat r of one fork budget on the task's trajectories (the variant's own seeds, so that a variant played
    with the audit or added to it later draws the same): the selector's picks (p(s_t) from the siblings, as in
    training), their forks' returns, env steps per row and seconds; with play False, only what the configured
    estimators need of the configured budget."""
    from crr.train.advantages import state_keys
    from crr.train.selectors import SelectorParams, select_each, sibling_values

    wanted = set().union(*(needs(n) for n in cfg.estimators))
    key = (r, *([zlib.crc32(variant.encode())] if variant else []))
    p = sibling_values([state_keys(t.steps) for t in trajs], [t.reward for t in trajs], [0] * len(trajs))
    rng = np.random.default_rng(derive_seed(cfg.seed, task_index, 2, *key))
    params = SelectorParams(k=budget["k"], eta=budget["eta"], lambda_type=budget["lambda_type"])
    picks = select_each(budget["selector"], trajs, params, rng, p) if play or "selected" in wanted else {}
    cf, steps, secs = (forks.play(trajs, picks, budget["cf_samples"], budget["proposal"], budget["cf_temperature"],
                                  derive_seed(cfg.seed, task_index, 3, *key), budget["horizon"])
                       if play or "counterfactuals" in wanted else ([], [0] * len(trajs), 0.0))
    return picks, _returns(cf, trajs), steps, secs


def _part(played: tuple, i: int, G: int) -> dict:
    """Row i's share of a `_budget_draw`: its picks, their scored returns and its cost."""
    picks, cf, steps, secs = played
    return {"selected": [s.t for s in picks.get(i, [])], "counterfactuals": _scored(cf[i]),
            "cost": {"env_steps": steps[i], "wall_s": secs / G}}


def audit_task(cfg: AuditConfig, task, task_index: int, forks: _Forks) -> list[dict]:
    """One task's G trajectories, the oracle's V and A* of every step, and R draws of each budget the
    configured estimators need (the selector's picks, their K forks' returns, K continuations of every
    step, with what each cost): one record per trajectory."""
    from crr.train.advantages import state_keys
    from crr.train.selectors import Selection

    G = cfg.group_size
    wanted = set().union(*(needs(n) for n in cfg.estimators))
    result, rollout_s = _trajectories(cfg, task, task_index, forks)
    trajs = result.trajectories
    try:
        scored = [i for i, t in enumerate(trajs) if t.reward is not None]
        every = {i: [Selection(t, 0.0) for t in range(len(trajs[i].steps))] for i in scored}
        oracle, oracle_steps, oracle_s = forks.play(trajs, every, cfg.continuations, "on_policy", cfg.temperature,
                                                    derive_seed(cfg.seed, task_index, 1),
                                                    verdicts=forks.oracle_verdicts)
        cont = _returns(oracle, trajs)
        truth = {i: values([cont[i].get(t, []) for t in range(len(trajs[i].steps))], trajs[i].reward)
                 for i in scored}
        draws: list[list[dict]] = [[] for _ in trajs]
        for r in range(cfg.repeats):
            played = {v: _budget_draw(cfg, trajs, task_index, forks, b, r, v, bool(v)) for v, b in budgets(cfg).items()}
            mc, mc_steps, mc_s = (forks.play(trajs, every, cfg.mc_samples, "on_policy", cfg.temperature,
                                             derive_seed(cfg.seed, task_index, 4, r))
                                  if "continuations" in wanted else ([], [0] * G, 0.0))
            mc = _returns(mc, trajs)
            for i in range(G):
                part = {v: _part(budget, i, G) for v, budget in played.items()}
                base = part.pop("")
                draws[i].append({"selected": base["selected"], "counterfactuals": base["counterfactuals"],
                                 "continuations": _scored(mc[i]),
                                 "cost": {"counterfactuals": base["cost"],
                                          "continuations": {"env_steps": mc_steps[i], "wall_s": mc_s / G}},
                                 **({"variants": part} if part else {})})
    finally:
        result.release()
    return [{"task_id": t.task_id, "task_index": task_index, "sibling": i, "reward": t.reward,
             "end_reason": t.end_reason, "steps": len(t.steps), "spans": [list(s.span) for s in t.steps],
             "actions": [s.call["name"] if s.call else None for s in t.steps],
             "state_keys": state_keys(t.steps),
             "truth": truth.get(i), "continuations": [cont[i].get(s, []) for s in range(len(t.steps))],
             "oracle": {"env_steps": oracle_steps[i], "wall_s": oracle_s / G,
                        "branches": sum(b.row == i and b.sample is not None for b in oracle)},
             "rollout_s": rollout_s / G, "draws": draws[i]} for i, t in enumerate(trajs)]


def added_variants(cfg: AuditConfig, task, task_index: int, forks: _Forks, records: list[dict],
                   names: list[str]) -> list[dict]:
    """Variants `names` played on a task already recorded (`records`, its G records) without the oracle: its
    trajectories sampled again, which must replay the records step for step, then each variant's R draws with
    the seeds it would have had in the audit itself. One VARIANTS record per (trajectory, variant)."""
    from crr.train.advantages import state_keys

    G = cfg.group_size
    result, _ = _trajectories(cfg, task, task_index, forks)
    trajs = result.trajectories
    try:
        by_sibling = {rec["sibling"]: rec for rec in records}
        for i, t in enumerate(trajs):
            rec = by_sibling[i]
            again = json.loads(json.dumps([t.reward, [list(s.span) for s in t.steps], state_keys(t.steps)]))
            if [rec["reward"], rec["spans"], rec["state_keys"]] != again:
                raise CRRError(f"task {task_index}'s trajectory {i} no longer replays as recorded (the policy, crr "
                               f"or the engine changed since the audit): variants can only be added on the audit's "
                               f"own code and model; start a new audit instead")
        draws = {v: [_budget_draw(cfg, trajs, task_index, forks, budgets(cfg)[v], r, v, True)
                     for r in range(cfg.repeats)] for v in names}
    finally:
        result.release()
    return [{"task_index": task_index, "sibling": i, "variant": v, "draws": [_part(d, i, G) for d in draws[v]]}
            for v in names for i in range(G)]


def _scored(returns: dict) -> dict[int, list[float]]:
    """t -> the scored returns (branches with an infrastructure failure left out; a step with none, out)."""
    return {t: [x for x in v if x is not None] for t, v in returns.items() if any(x is not None for x in v)}


def audit(cfg: AuditConfig, run: RunDir, *, on_task: Callable[[int, int, dict], None] | None = None) -> None:
    """Run (or resume) the audit into `run`: records.jsonl, and a `task` record per task in metrics.jsonl
    (the table, the plot and summary.json: crr.report.credit.write_audit)."""
    import torch

    from crr.agent.episode import EpisodeConfig
    from crr.policy.backend import TransformersBackend
    from crr.eval.evaluate import load_eval_policy, resolve_policy
    from crr.policy.model import agent_record, default_policy_dir
    from crr.sandbox import engine_spec_of
    from crr.rollout import rollout_pool
    from crr.tasks.loaders import load_tasks

    tasks = load_tasks(cfg.tasks)[:cfg.n_tasks]
    if not tasks:
        raise CRRError(f"{cfg.tasks} holds no tasks")
    recorded = audit_records(run.path)
    done = {(r["task_index"], r["sibling"]) for r in recorded}
    todo = [i for i in range(len(tasks)) if any((i, g) not in done for g in range(cfg.group_size))]
    if not todo and not _lacking(cfg, recorded):   # a finished audit: no model to load
        _save_variants(cfg, run)
        return
    model_dir = cfg.model or str(default_policy_dir())
    record = agent_record(model_dir)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_eval_policy(resolve_policy(model_dir), dtype=cfg.dtype)   # an adapter merged, as eval's
    episode = EpisodeConfig(max_turns=cfg.max_turns or record.get("max_turns", 50), temperature=cfg.temperature,
                            max_new_tokens=cfg.max_new_tokens, time_limit_s=cfg.episode_time_limit_s,
                            snapshots=True, digests=True,
                            agent_format=cfg.agent_format or record.get("agent_format", "paper"))
    backend = TransformersBackend(model, tokenizer)
    run.log_metrics({"event": "start", "tasks": len(tasks), "todo": len(todo), "estimators": cfg.estimators,
                     "model": model_dir, "dtype": str(model.dtype).removeprefix("torch."),
                     "episode": dataclasses.asdict(episode)})
    with engine_spec_of(cfg).make() as engine:
        pool = rollout_pool(engine, cfg.workers)
        try:
            forks = _Forks(run, backend, engine, tokenizer, episode, pool)

            def counts() -> tuple[float, int, int]:
                return time.perf_counter(), forks.rollouts, forks.oracle_verdicts.reused

            def finished(n: int, total: int, i: int, before: tuple[float, int, int], **extra) -> None:
                """A task's metrics record (its own seconds, rollouts and spared oracle test runs) and progress."""
                t0, rollouts, reused = before
                info = {"event": "task", "task_index": i, "task_id": tasks[i].instance_id, **extra,
                        "wall_s": time.perf_counter() - t0, "rollouts": forks.rollouts - rollouts,
                        "oracle_verdicts_reused": forks.oracle_verdicts.reused - reused}
                run.log_metrics(info)
                if on_task is not None:
                    on_task(n + 1, total, info)

            for n, i in enumerate(todo):
                before = counts()
                for rec in audit_task(cfg, tasks[i], i, forks):
                    if (i, rec["sibling"]) not in done:
                        run.append(RECORDS, rec)
                finished(n, len(todo), i, before)
            recorded = audit_records(run.path)
            lacking = _lacking(cfg, recorded)
            for n, (i, missing) in enumerate(sorted(lacking.items())):
                before = counts()
                mine = [r for r in recorded if r["task_index"] == i]
                for added in added_variants(cfg, tasks[i], i, forks, mine, sorted({v for _, v in missing})):
                    if (added["sibling"], added["variant"]) in missing:
                        run.append(VARIANTS, added)
                finished(n, len(lacking), i, before, variants_added=True)
        finally:
            pool.close()
    _save_variants(cfg, run)


def _save_variants(cfg: AuditConfig, run: RunDir) -> None:
    """The run's config gains the variants added to it, once every record has their draws (until then the
    report scores what the config names, which every record has)."""
    if cfg.variants != audit_config(run.config).variants:
        run.write_text("config.yaml", yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


def _lacking(cfg: AuditConfig, records: list[dict]) -> dict[int, set[tuple[int, str]]]:
    """task index -> the (sibling, variant) pairs of configured variants its `records` lack (variants added to a
    recorded audit)."""
    out: dict[int, set[tuple[int, str]]] = {}
    for rec in records:
        for v in cfg.variants:
            if any(v not in d.get("variants", {}) for d in rec["draws"]):
                out.setdefault(rec["task_index"], set()).add((rec["sibling"], v))
    return out


def advantages(records: list[dict], cfg: AuditConfig) -> dict[str, list[list[list[float] | None]]]:
    """Each scored estimator's advantages from the recorded budgets: name -> per record, per repeat, the
    step advantages (None: an excluded row), via crr.train.advantages.estimate on the rows of each task's
    recorded siblings, filled as the contract says with what the estimator needs."""
    from crr.train.advantages import RowCredit, estimate

    groups: dict[int, list[int]] = {}
    for j, rec in enumerate(records):
        groups.setdefault(rec["task_index"], []).append(j)
    out: dict[str, list] = {}
    for name in estimator_names(cfg):
        estimator, variant = variant_of(name)
        need, per = needs(estimator), [[] for _ in records]
        for task_index, members in groups.items():
            for r in range(min(len(records[j]["draws"]) for j in members)):
                rows = []
                for j in members:
                    rec, d = records[j], _draw(records[j]["draws"][r], variant)
                    rows.append(RowCredit(
                        group_key=task_index, reward=rec["reward"], spans=[tuple(s) for s in rec["spans"]],
                        selected=d["selected"] if "selected" in need else [],
                        counterfactuals=({int(t): v for t, v in d["counterfactuals"].items()}
                                         if "counterfactuals" in need else {}),
                        state_keys=rec["state_keys"] if "state_keys" in need else [],
                        continuations=({int(t): v for t, v in d["continuations"].items()}
                                       if "continuations" in need else {})))
                for j, adv in zip(members, estimate(estimator, rows, **cfg.advantage_params.get(estimator, {}))):
                    per[j].append(adv)
        out[name] = per
    return out


def _draw(d: dict, variant: str) -> dict:
    """A recorded draw as the configured budget's: for a variant, its picks, forks and their cost in place."""
    if not variant:
        return d
    v = d["variants"][variant]
    return {**d, "selected": v["selected"], "counterfactuals": v["counterfactuals"],
            "cost": {**d["cost"], "counterfactuals": v["cost"]}}


def _cost(rec: dict, name: str, key: str) -> float:
    estimator, variant = variant_of(name)
    need = needs(estimator)
    return float(np.mean([sum(_draw(d, variant)["cost"][b][key] for b in ("counterfactuals", "continuations")
                              if b in need) for d in rec["draws"]])) if rec["draws"] else 0.0


def frames(records: list[dict], cfg: AuditConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(steps, costs): one row per (estimator, trajectory, repeat, step) with its estimate a and the
    oracle's A* (steps with A* known only), and one per (estimator, trajectory) with its mean extra
    environment steps and seconds per draw."""
    rows, costs = [], []
    for name, per in advantages(records, cfg).items():
        for rec, draws in zip(records, per):
            if rec["truth"] is None:
                continue
            traj = f"{rec['task_index']}/{rec['sibling']}"
            costs.append({"estimator": name, "traj": traj, "env_steps": _cost(rec, name, "env_steps"),
                          "wall_s": _cost(rec, name, "wall_s")})
            for r, adv in enumerate(draws):
                if adv is None:
                    continue
                for t, (a, truth) in enumerate(zip(adv, rec["truth"])):
                    if truth["A"] is not None:
                        rows.append({"estimator": name, "traj": traj, "repeat": r, "t": t, "a": a, **truth})
    return pd.DataFrame(rows), pd.DataFrame(costs)


def metrics_frame(records: list[dict], cfg: AuditConfig) -> pd.DataFrame:
    """One row per estimator: crr.credit.stats.estimator_metrics plus its extra environment steps and
    seconds per trajectory."""
    steps, costs = frames(records, cfg)
    if steps.empty:
        return pd.DataFrame()
    cost = costs.groupby("estimator")[["env_steps", "wall_s"]].mean()
    grpo = steps[steps["estimator"] == "grpo"].set_index(["traj", "repeat", "t"])["a"]
    out = []
    for name in dict.fromkeys(steps["estimator"]):
        part = steps[steps["estimator"] == name].reset_index(drop=True)
        aligned = grpo.reindex(pd.MultiIndex.from_frame(part[["traj", "repeat", "t"]])) if len(grpo) else None
        m = estimator_metrics(part, aligned, boot=cfg.bootstrap, seed=cfg.seed)
        out.append({"estimator": name, "repeats": int(part["repeat"].nunique()),
                    "trajectories": int(part["traj"].nunique()), **m,
                    "extra_env_steps_per_traj": float(cost.loc[name, "env_steps"]),
                    "extra_wall_s_per_traj": float(cost.loc[name, "wall_s"])})
    return pd.DataFrame(out)


def is_audit(path: Path) -> bool:
    manifest = path / "manifest.json"
    return manifest.is_file() and read_run_mapping(manifest).get("command") == "credit-audit"

