"""The credit audit's table and figure (`crr credit audit` run directories, crr.credit.audit): per estimator,
how its step advantages track the true step advantage A*, and what its own forks cost. `crr report tables|plots`
writes them for every audit run at or under --runs; the audit writes them into its own run directory."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from crr.credit.audit import (TABLE, AuditConfig, audit_config, audit_records, budgets, estimator_names,
                              is_audit, metrics_frame, variant_of)
from crr.report.output import write_table
from crr.report.plots import Plot, _save
from crr.report.tables import DASH, Table
from crr.rundir import RunDir


def _budget(name: str, cfg: AuditConfig) -> str:
    estimator, variant = variant_of(name)
    b = budgets(cfg)[variant]
    picks = f"{b['selector']} (eta={b['eta']:g}" + (f", h={b['horizon']})" if b["horizon"] is not None else ")")
    return {"grpo": "none", "crr": f"{picks}, k={b['k']} picks x K={b['cf_samples']} forks",
            "zero_contrast": f"{picks}, k={b['k']} picks, no forks", "gigpo": "state keys",
            "mc_values": f"K={cfg.mc_samples} continuations per step"}.get(estimator, "all of the above")


def _num(x: float, digits: int = 2) -> str:
    return DASH if x is None or math.isnan(x) else f"{x:+.{digits}f}" if digits == 2 else f"{x:.{digits}f}"


def _ci(x: float, lo: float, hi: float) -> str:
    return DASH if math.isnan(x) else f"{x:+.2f} [{_num(lo)}, {_num(hi)}]"


def audit_table(path: Path, records: list[dict], cfg: AuditConfig, name: str = TABLE) -> Table:
    data = metrics_frame(records, cfg)
    scored = [r for r in records if r["truth"] is not None]
    steps = sum(r["steps"] for r in scored)
    caption = (f"Credit audit ({path.name}): {len(scored)} scored trajectories of "
               f"{cfg.model or 'the default policy'} on {cfg.tasks} (G={cfg.group_size}, T={cfg.temperature}), {steps} "
               "steps. A*(t) = V(s_t+1) - V(s_t) from "
               f"M={cfg.continuations} on-policy continuations per step (Wilson/Newcombe 95 % intervals); each "
               f"estimator on its own budget, its random draws repeated R={cfg.repeats} times. Correlations over "
               "(step, repeat) pairs with 95 % bootstrap intervals over trajectories (against GRPO's: paired, the same "
               "resampled trajectories for both); sign agreement on the steps "
               "whose A* interval excludes 0; MSE = bias^2 + variance (over the R draws).")
    table = Table(name, "Step credit against the true step advantage A*", caption)
    if data.empty:
        table.notes.append("no trajectory with a scored oracle yet")
        return table
    oracle = [r["oracle"] for r in scored]
    table.notes.append(f"the oracle: {np.mean([o['env_steps'] for o in oracle]):.1f} environment steps and "
                       f"{np.mean([o['wall_s'] for o in oracle]):.1f} s per trajectory")
    scored = set(estimator_names(cfg))   # (a module.path:function is scored)
    missing = [n for n in cfg.estimators if n not in scored]
    if missing:
        table.notes.append(f"not registered in this checkout's crr.train.advantages, left out (their budgets are "
                           f"in the records: `crr report` scores them once they are): {', '.join(missing)}")
    data.insert(1, "budget", [_budget(n, cfg) for n in data["estimator"]])
    table.data = data
    table.display = pd.DataFrame({
        "Estimator": data["estimator"], "Own budget": data["budget"],
        "Pearson [95 % CI]": [_ci(r.pearson, r.pearson_lo, r.pearson_hi) for r in data.itertuples()],
        "Spearman [95 % CI]": [_ci(r.spearman, r.spearman_lo, r.spearman_hi) for r in data.itertuples()],
        "Pearson - GRPO's [paired 95 % CI]": [DASH if r.estimator == "grpo" else
                                              _ci(r.pearson_vs_grpo, r.pearson_vs_grpo_lo, r.pearson_vs_grpo_hi)
                                              for r in data.itertuples()],
        "Sign agr. (n)": [f"{DASH if math.isnan(r.sign_agreement) else f'{100 * r.sign_agreement:.0f} %'} "
                          f"({r.n_significant})" for r in data.itertuples()],
        "MSE": [f"{r.mse:.3f}" for r in data.itertuples()],
        "bias^2": [f"{r.bias2:.3f}" for r in data.itertuples()],
        "variance": [f"{r.variance:.3f}" for r in data.itertuples()],
        "≠ GRPO": [DASH if math.isnan(r.differs_from_grpo) else f"{100 * r.differs_from_grpo:.0f} %"
                   for r in data.itertuples()],
        "Extra env steps / traj": [f"{r.extra_env_steps_per_traj:.1f}" for r in data.itertuples()],
        "Extra s / traj": [f"{r.extra_wall_s_per_traj:.2f}" for r in data.itertuples()]})
    return table


def audit_plot(path: Path, out: Path, records: list[dict], cfg: AuditConfig, name: str = TABLE) -> Plot:
    plot = Plot(name, "Step credit against the true step advantage A*")
    data = metrics_frame(records, cfg)
    if data.empty:
        return plot
    # one row per estimator, read across the four panels (horizontal bars stay legible with many variants)
    y = np.arange(len(data))[::-1]
    fig = Figure(figsize=(15, 1.4 + 0.32 * len(data)))
    ax1, ax2, ax3, ax4 = fig.subplots(1, 4, sharey=True)
    for off, col, label in ((0.18, "pearson", "Pearson"), (-0.18, "spearman", "Spearman")):
        v = data[col].to_numpy(float)
        err = np.array([v - data[f"{col}_lo"].to_numpy(float), data[f"{col}_hi"].to_numpy(float) - v])
        ax1.barh(y + off, np.nan_to_num(v), 0.36, xerr=np.nan_to_num(err), capsize=2, label=label)
    if "grpo" in set(data["estimator"]):
        ax1.axvline(float(data.set_index("estimator").loc["grpo", "pearson"]), color="gray", ls="--", lw=0.8,
                    label="GRPO's Pearson")
    ax1.axvline(0, color="black", lw=0.5)
    ax1.set(title="correlation with A* (95 % CI)", yticks=y)
    ax1.set_yticklabels(data["estimator"])
    ax1.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0.0, -0.1), frameon=False)   # below the bars
    ax2.barh(y, 100 * np.nan_to_num(data["sign_agreement"].to_numpy(float)))
    ax2.set(title=f"sign agreement where A* != 0 ({int(data['n_significant'].max())} steps)", xlabel="%",
            xlim=(0, 100))
    ax3.barh(y, data["bias2"], label="bias^2")
    ax3.barh(y, data["variance"], left=data["bias2"], label="variance")
    ax3.set(title="MSE against A*")
    ax3.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(0.0, -0.1), frameon=False)
    ax4.barh(y, data["extra_env_steps_per_traj"])
    ax4.set(title="cost: extra environment steps / trajectory")
    fig.suptitle(f"{path.name}: M={cfg.continuations}, R={cfg.repeats}", fontsize=9)
    fig.tight_layout()
    plot.files = _save(fig, out, name)
    return plot


def _audits(paths: list[Path]) -> list[Path]:
    found = [p for root in paths
             for p in ([root] if is_audit(root) else sorted(q.parent for q in root.rglob("manifest.json")))
             if is_audit(p)]
    return sorted(set(found))


def _load(path: Path) -> tuple[list[dict], AuditConfig]:
    import yaml

    return audit_records(path), audit_config(yaml.safe_load((path / "config.yaml").read_text()))


def _name(path: Path, many: bool) -> str:
    return f"{TABLE}-{path.name}" if many else TABLE


def credit_tables(paths: list[Path]) -> list[Table]:
    """The audit table of every `crr credit audit` run at or under `paths`."""
    audits = _audits(paths)
    return [audit_table(p, *_load(p), name=_name(p, len(audits) > 1)) for p in audits]


def credit_plots(paths: list[Path], out: Path) -> list[Plot]:
    audits = _audits(paths)
    return [audit_plot(p, out, *_load(p), name=_name(p, len(audits) > 1)) for p in audits]


def write_audit(run: RunDir) -> dict:
    """The table (md, csv, tex), the plot and summary.json from the run's records."""
    records = audit_records(run.path)
    cfg = audit_config(run.config)
    table = audit_table(run.path, records, cfg)
    write_table(table, run.path)
    plot = audit_plot(run.path, run.path, records, cfg)
    tasks = [r for r in run.records("metrics.jsonl") if r.get("event") == "task"]
    wall = sum(r["wall_s"] for r in tasks)
    rollouts = sum(r["rollouts"] for r in tasks)
    scored = [r for r in records if r["reward"] is not None]
    summary = {"trajectories": len(records), "scored": len(scored),
               "pass_rate": sum(r["reward"] for r in scored) / len(scored) if scored else None,
               "steps": sum(r["steps"] for r in records),
               "oracle_continuations": sum(r["oracle"]["branches"] for r in records),
               "oracle_env_steps": sum(r["oracle"]["env_steps"] for r in records),
               "tasks_done": len(tasks), "wall_s": wall, "rollouts": rollouts,
               "rollouts_per_s": rollouts / wall if wall else None,
               "table": [f"{TABLE}.md", f"{TABLE}.csv"], "plot": [p.name for p in plot.files],
               "estimators": [] if table.data is None else
               [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
                for row in table.data.to_dict("records")]}
    run.write_json("summary.json", summary)
    return summary
