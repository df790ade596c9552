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
normal budget, never the oracle's forks:

    grpo           the rows' rewards and groups
    crr            the selector's picks (k) and K counterfactual branches of each (the `tempered` proposal)
    zero_contrast  the same picks, no forks
    gigpo          per-step state keys (the tree digest of s_t and what the agent has observed)
    mc_values      K on-policy continuations of every step
    (any other registered estimator: everything above)

Its random draws (branches, continuations, a random selector) are repeated R times, so that its variance is
measured. One record per trajectory goes to records.jsonl as soon as its task is done (append-only, fsynced); a
rerun on the run directory skips the trajectories recorded already, so an interrupted audit resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from crr.credit.stats import estimator_metrics, values
from crr.errors import CRRError
from crr.experiments import read_preset
from crr.rundir import RunDir

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
TABLE = "credit_audit"
FORKING = {"crr", "zero_contrast"}            # estimators that use the selector's picks
STATELESS = {"grpo"}
EXCLUDED = {"search_select"}                  # swaps sequences: not a step advantage on the realised rows


@dataclass
class AuditConfig:
    """Every hyperparameter of an audit (experiments/credit-audit-nano.yaml)."""
    model: str | None = None             # None: crr's default policy (crr.policy.model.default_policy_dir)
    tasks: str = "nano-band"
    n_tasks: int = 8                     # the first N tasks; N x G trajectories
    group: int = 4                       # G siblings per task, as in training
    continuations: int = 16              # M: the oracle's on-policy continuations per step
    repeats: int = 3                     # R: each estimator's random draws, repeated
    seed: int = 11
    temperature: float = 0.6             # the rollout temperature (trajectories, continuations)
    max_turns: int | None = None         # H; None: the model's recorded turn cap, else 50
    max_new_tokens: int = 96
    agent_format: str | None = None      # None: the model's recorded format
    episode_time_limit_s: float = 600.0
    engine: str = "local"
    ray: str | None = None
    mode: str | None = None
    workers: int | None = None
    estimators: list[str] | None = None  # None: every registered estimator but search_select
    # each estimator's own budget
    k: int = 4                           # CRR's fork budget per trajectory (its selector's picks)
    cf_samples: int = 2                  # CRR's K counterfactuals per pick
    cf_temperature: float = 0.7          # T_cf
    selector: str = "entropy_type"
    proposal: str = "tempered"
    eta: float = 0.4
    lambda_type: float = 0.6
    mc_samples: int = 2                  # mc_values' K continuations per step
    advantage_params: dict = field(default_factory=dict)   # estimator -> its keyword params (gigpo: {omega: 1.0})
    bootstrap: int = 1000                # resamples of trajectories for the correlations' intervals

    def __post_init__(self) -> None:
        for name in ("n_tasks", "group", "continuations", "repeats", "cf_samples", "mc_samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise CRRError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.k < 0:
            raise CRRError(f"k must be >= 0, got {self.k}")
        if self.temperature <= 0 or self.cf_temperature <= 0:
            raise CRRError("temperature and cf_temperature must be > 0 (the continuations sample from pi)")


def load_audit_config(preset: Path | str | None = None, overrides: dict | None = None) -> AuditConfig:
    data = read_preset(preset) if preset is not None else {}
    data.update(overrides or {})
    names = {f.name for f in dataclasses.fields(AuditConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise CRRError(f"unknown audit config key(s) {unknown}; see experiments/credit-audit-nano.yaml")
    return AuditConfig(**data)


def parse_overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CRRError(f"override {pair!r} is not key=value (e.g. continuations=8)")
        out[key] = yaml.safe_load(value)
    return out


def start_audit(cfg: AuditConfig, out: Path | str) -> RunDir:
    return RunDir.create("credit-audit", f"n{cfg.n_tasks}-g{cfg.group}-m{cfg.continuations}-seed{cfg.seed}",
                         root=out, config=dataclasses.asdict(cfg), seeds={"audit": cfg.seed})


def resume_audit(path: Path | str) -> tuple[AuditConfig, RunDir]:
    run = RunDir.open(path, write=True)
    if run.manifest.get("command") != "credit-audit":
        raise CRRError(f"{path} is not a `crr credit audit` run directory")
    return AuditConfig(**run.config), run


def estimator_names(cfg: AuditConfig) -> list[str]:
    """The configured estimators that are registered (a missing one is named in the log), GRPO first."""
    from crr.train.advantages import ESTIMATORS

    wanted = cfg.estimators if cfg.estimators is not None else [n for n in ESTIMATORS if n not in EXCLUDED]
    missing = [n for n in wanted if n not in ESTIMATORS]
    if missing:
        log.warning("estimators not registered in crr.train.advantages, left out of the audit: %s", missing)
    names = [n for n in wanted if n in ESTIMATORS]
    return sorted(names, key=lambda n: n != "grpo")


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def state_key(steps, t: int) -> str:
    """s_t's key for GiGPO: the tree digest before a_t plus what the agent has observed (the observations
    of a_0..a_{t-1})."""
    seen = json.dumps([steps[t].digest] + [s.observation for s in steps[:t]])
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


class _Forks:
    """Plays forked branches of a task's trajectories through the training machinery (run_branches: one
    batched generation per round, the tool calls in the worker pool) and counts their cost."""

    def __init__(self, run: RunDir, backend, engine, tokenizer, episode, pool):
        self.run, self.backend, self.engine, self.tokenizer, self.episode, self.pool = (
            run, backend, engine, tokenizer, episode, pool)
        self.rollouts = 0   # trajectories and branches played

    def play(self, trajs, picks: dict, samples: int, proposal: str, temperature: float, seed: int):
        """The branches (crr.train.counterfactual.Branch), their environment steps per row, and seconds."""
        from crr.train.counterfactual import run_branches
        from crr.train.ledger import Ledger

        ledger = Ledger(self.run, writer=False)   # run_branches charges its phases there; never saved
        ledger.begin(0)
        start = time.perf_counter()
        branches = run_branches(trajs, picks, cf_samples=samples, backend=self.backend, engine=self.engine,
                                tokenizer=self.tokenizer, episode=self.episode, proposal=proposal,
                                cf_temperature=temperature, seed=seed, horizon=None, pool=self.pool, ledger=ledger)
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


def audit_task(cfg: AuditConfig, task, task_index: int, forks: _Forks, names: list[str]) -> list[dict]:
    """One task's G trajectories, the oracle's V and A* of every step, each estimator's advantages (R
    draws): one record per trajectory."""
    from crr.rollout import RolloutConfig, rollout
    from crr.train.advantages import RowCredit, estimate
    from crr.train.selectors import Selection, SelectorParams, select

    G = cfg.group
    start = time.perf_counter()
    result = rollout([task], forks.backend, forks.engine, forks.tokenizer,
                     RolloutConfig(group=G, seed=_seed(cfg.seed, task_index, 0), episode=forks.episode),
                     pool=forks.pool)
    rollout_s = time.perf_counter() - start
    trajs = result.trajectories
    forks.rollouts += len(trajs)
    try:
        scored = [i for i, t in enumerate(trajs) if t.reward is not None]
        every = {i: [Selection(t, 0.0) for t in range(len(trajs[i].steps))] for i in scored}
        oracle, oracle_steps, oracle_s = forks.play(trajs, every, cfg.continuations, "on_policy", cfg.temperature,
                                                    _seed(cfg.seed, task_index, 1))
        cont = _returns(oracle, trajs)
        truth = {i: values([cont[i].get(t, []) for t in range(len(trajs[i].steps))], trajs[i].reward)
                 for i in scored}
        keys = [[state_key(t.steps, s) for s in range(len(t.steps))] for t in trajs]
        spans = [[s.span for s in t.steps] for t in trajs]
        draws: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(cfg.repeats):
            rng = np.random.default_rng(_seed(cfg.seed, task_index, 2, r))
            params = SelectorParams(k=cfg.k, eta=cfg.eta, lambda_type=cfg.lambda_type)
            picks = {i: select(cfg.selector, trajs[i].steps, params, rng) for i in scored}
            cache: dict[str, tuple] = {}

            def budget(kind: str, r=r, picks=picks, cache=cache) -> tuple:
                if kind not in cache:
                    if kind == "crr":
                        br, st, s = forks.play(trajs, picks, cfg.cf_samples, cfg.proposal, cfg.cf_temperature,
                                               _seed(cfg.seed, task_index, 3, r))
                    else:
                        br, st, s = forks.play(trajs, every, cfg.mc_samples, "on_policy", cfg.temperature,
                                               _seed(cfg.seed, task_index, 4, r))
                    cache[kind] = (_returns(br, trajs), st, s)
                return cache[kind]

            for name in names:
                needs = _needs(name)
                cf, st_cf, s_cf = budget("crr") if "counterfactuals" in needs else ([{}] * G, [0] * G, 0.0)
                mc, st_mc, s_mc = budget("mc") if "continuations" in needs else ([{}] * G, [0] * G, 0.0)
                rows = [RowCredit(group=task_index, reward=t.reward, spans=spans[i],
                                  selected=[p.t for p in picks.get(i, [])] if "selected" in needs else [],
                                  counterfactuals={k: [x for x in v if x is not None] for k, v in cf[i].items()
                                                   if any(x is not None for x in v)},
                                  state_keys=keys[i] if "state_keys" in needs else [],
                                  continuations={k: [x for x in v if x is not None] for k, v in mc[i].items()
                                                 if any(x is not None for x in v)})
                        for i, t in enumerate(trajs)]
                t0 = time.perf_counter()
                adv = estimate(name, rows, **cfg.advantage_params.get(name, {}))
                est_s = time.perf_counter() - t0
                draws[name].append({"advantages": adv, "env_steps": [a + b for a, b in zip(st_cf, st_mc)],
                                    "wall_s": (s_cf + s_mc + est_s) / G})
    finally:
        result.release()
    records = []
    for i, t in enumerate(trajs):
        records.append({
            "task_id": t.task_id, "task_index": task_index, "group": i, "reward": t.reward,
            "end_reason": t.end_reason, "steps": len(t.steps),
            "actions": [s.call["name"] if s.call else None for s in t.steps], "state_keys": keys[i],
            "truth": truth.get(i), "continuations": [cont[i].get(s, []) for s in range(len(t.steps))],
            "oracle": {"env_steps": oracle_steps[i], "wall_s": oracle_s / G,
                       "branches": sum(b.row == i and b.sample is not None for b in oracle)},
            "rollout_s": rollout_s / G,
            "estimators": {n: {"advantages": [d["advantages"][i] for d in draws[n]],
                               "env_steps": [d["env_steps"][i] for d in draws[n]],
                               "wall_s": [d["wall_s"] for d in draws[n]]} for n in names},
        })
    return records


def _needs(name: str) -> set[str]:
    """What of an estimator's own budget its rows are filled with."""
    if name in STATELESS:
        return set()
    if name == "crr":
        return {"selected", "counterfactuals"}
    if name == "zero_contrast":
        return {"selected"}
    if name == "gigpo":
        return {"state_keys"}
    if name == "mc_values":
        return {"continuations"}
    return {"selected", "counterfactuals", "state_keys", "continuations"}


def audit(cfg: AuditConfig, run: RunDir, *, on_task: Callable[[int, int, dict], None] | None = None) -> None:
    """Run (or resume) the audit into `run`: records.jsonl, and a `task` record per task in metrics.jsonl
    (the table, the plot and summary.json: crr.report.credit.write_audit)."""
    import torch

    from crr.agent.episode import EpisodeConfig
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import agent_record, default_policy_dir, load_policy
    from crr.replay import engine_options, get_engine
    from crr.rollout import rollout_pool
    from crr.tasks.loaders import load_tasks

    tasks = load_tasks(cfg.tasks)[:cfg.n_tasks]
    if not tasks:
        raise CRRError(f"{cfg.tasks} holds no tasks")
    done = {(r["task_index"], r["group"]) for r in run.records(RECORDS)}
    todo = [i for i in range(len(tasks)) if any((i, g) not in done for g in range(cfg.group))]
    names = estimator_names(cfg)
    if not todo:   # a finished audit: no model to load
        return
    model_dir = cfg.model or str(default_policy_dir())
    record = agent_record(model_dir)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(model_dir)
    episode = EpisodeConfig(max_turns=cfg.max_turns or record.get("max_turns", 50), temperature=cfg.temperature,
                            max_new_tokens=cfg.max_new_tokens, time_limit_s=cfg.episode_time_limit_s,
                            snapshots=True, digests=True, agent_format=cfg.agent_format or record.get("agent_format", "paper"))
    backend = TransformersBackend(model, tokenizer)
    run.log_metrics({"event": "start", "tasks": len(tasks), "todo": len(todo), "estimators": names,
                     "model": model_dir, "episode": dataclasses.asdict(episode)})
    with get_engine(cfg.engine, **engine_options(cfg.engine, ray=cfg.ray, mode=cfg.mode)) as engine:
        pool = rollout_pool(engine, cfg.workers)
        try:
            forks = _Forks(run, backend, engine, tokenizer, episode, pool)
            for n, i in enumerate(todo):
                t0, before = time.perf_counter(), forks.rollouts
                records = audit_task(cfg, tasks[i], i, forks, names)
                for rec in records:
                    if (i, rec["group"]) not in done:
                        run.append(RECORDS, rec)
                info = {"event": "task", "task_index": i, "task_id": tasks[i].instance_id,
                        "wall_s": time.perf_counter() - t0, "rollouts": forks.rollouts - before}
                run.log_metrics(info)
                if on_task is not None:
                    on_task(n + 1, len(todo), info)
        finally:
            pool.close()


def frames(records: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(steps, costs): one row per (estimator, trajectory, repeat, step) with its estimate a and the
    oracle's A* (steps with A* known only), and one per (estimator, trajectory) with its mean extra
    environment steps and seconds."""
    rows, costs = [], []
    for rec in records:
        if rec["truth"] is None:
            continue
        traj = f"{rec['task_index']}/{rec['group']}"
        for name, est in rec["estimators"].items():
            costs.append({"estimator": name, "traj": traj, "env_steps": float(np.mean(est["env_steps"])),
                          "wall_s": float(np.mean(est["wall_s"]))})
            for r, adv in enumerate(est["advantages"]):
                if adv is None:
                    continue
                for t, (a, truth) in enumerate(zip(adv, rec["truth"])):
                    if truth["A"] is not None:
                        rows.append({"estimator": name, "traj": traj, "repeat": r, "t": t, "a": a, **truth})
        costs.append({"estimator": "oracle (A*)", "traj": traj, "env_steps": rec["oracle"]["env_steps"],
                      "wall_s": rec["oracle"]["wall_s"]})
    return pd.DataFrame(rows), pd.DataFrame(costs)


def metrics_frame(records: list[dict], *, boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One row per estimator: crr.credit.stats.estimator_metrics plus its extra environment steps and
    seconds per trajectory."""
    steps, costs = frames(records)
    if steps.empty:
        return pd.DataFrame()
    cost = costs.groupby("estimator")[["env_steps", "wall_s"]].mean()
    grpo = steps[steps["estimator"] == "grpo"].set_index(["traj", "repeat", "t"])["a"]
    out = []
    order = sorted(steps["estimator"].unique(), key=lambda n: (n != "grpo", n))
    for name, part in ((n, steps[steps["estimator"] == n]) for n in order):
        aligned = grpo.reindex(pd.MultiIndex.from_frame(part[["traj", "repeat", "t"]])) if len(grpo) else None
        m = estimator_metrics(part.reset_index(drop=True), aligned, boot=boot, seed=seed)
        out.append({"estimator": name, "repeats": int(part["repeat"].nunique()),
                    "trajectories": int(part["traj"].nunique()), **m,
                    "extra_env_steps_per_traj": float(cost.loc[name, "env_steps"]),
                    "extra_wall_s_per_traj": float(cost.loc[name, "wall_s"])})
    return pd.DataFrame(out)


def is_audit(path: Path) -> bool:
    manifest = path / "manifest.json"
    return manifest.is_file() and json.loads(manifest.read_text()).get("command") == "credit-audit"

