"""The paper's figures from run directories (matplotlib, no display needed): sample efficiency (pass@1 of
evaluated checkpoints against on-policy trajectories and against wall clock), the training reward on the same
two axes, the four ablation panels (k, selector, horizon, T_cf), advantage SNR and bucket covariance over
updates, and per-repository pass@1. Each is written as PNG and PDF; a figure without data says which runs
to make, like the tables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

from crr.report.runs import Runs
from crr.report.tables import (
    FACTORS,
    Missing,
    Needs,
    _label,
    _main_spec,
    _primary,
    ablation_table,
    main_arms,
    pct,
    per_repo_table,
)


@dataclass
class Plot:
    name: str
    title: str
    files: list[Path] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _save(fig: Figure, out: Path, name: str) -> list[Path]:
    """`name`.png and .pdf, each saved beside it and renamed: an interrupted save leaves the earlier file whole."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    options = ({"dpi": 150, "metadata": {"Software": None}}, {"metadata": {"CreationDate": None}})  # byte-stable PDFs
    for path, kwargs in zip(paths, options):
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            fig.savefig(tmp, format=path.suffix[1:], bbox_inches="tight", **kwargs)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return paths


def _time_unit(seconds: float) -> tuple[float, str]:
    return (3600.0, "hours") if seconds >= 3600 else (1.0, "seconds")


def _curve_arms(runs: Runs):
    """The main arms plus the equal-wall-clock arm (the continuing run of the right-hand panel)."""
    spec = _main_spec(runs)
    arms, _ = main_arms(runs, spec)
    if spec is not None:
        arms += [runs.catalogue.ref(spec, a.name) for a in spec.arms.values() if a.budget_from]
    return spec, arms


def sample_efficiency(runs: Runs, out: Path) -> Plot:
    spec, arms = _curve_arms(runs)
    needs = Needs(runs, spec)
    plot = Plot("sample_efficiency", "Sample efficiency: pass@1 against on-policy trajectories and wall clock",
                missing=needs.missing)
    ev = _primary(spec, runs)
    points = []
    for ref in arms:
        for run in needs.train(ref):
            if ev is None:
                continue
            for step in needs.planned(run, ev):   # notes the checkpoints the spec wants evaluated
                needs.eval(run, ev, step)
            found = sorted((e for e in runs.evals if e.train is run and e.complete and e.dataset == ev.dataset
                            and e.samples == 1 and e.step), key=lambda e: e.step)
            for rank, e in enumerate({e.step: e for e in found}.values()):   # every evaluated checkpoint
                c = run.cumulative(e.step)
                points.append({"arm": _label(ref), "seed": run.seed, "rank": rank, "trajectories": c["trajectories"],
                               "wall_s": c["wall_s"], "pass_at_1": pct(e.summary["pass_at_1"])})
    if not points:
        return plot
    df = pd.DataFrame(points).groupby(["arm", "rank"], sort=False).mean(numeric_only=True).reset_index()
    scale, unit = _time_unit(df["wall_s"].max())
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2, sharey=True)
    for arm, d in df.groupby("arm", sort=False):
        left.plot(d.trajectories, d.pass_at_1, marker="o", label=arm)
        right.plot(d.wall_s / scale, d.pass_at_1, marker="o", label=arm)
    left.set(xlabel="on-policy trajectories (counterfactual suffixes excluded)", ylabel=f"{ev.dataset} pass@1 (%)")
    right.set(xlabel=f"training wall clock ({unit}, forks charged)")
    left.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle("Pass@1 against two budgets (seed means at evaluated checkpoints)")
    plot.files = _save(fig, out, plot.name)
    return plot


def _train_frames(needs: Needs, arms) -> pd.DataFrame | None:
    """Every update of every finished train run of these arms, one frame (None when there is none)."""
    frames = [f for ref in arms for run in needs.train(ref) if not (f := run.frame()).empty]
    return pd.concat(frames, ignore_index=True) if frames else None


def train_reward(runs: Runs, out: Path) -> Plot:
    spec, arms = _curve_arms(runs)
    needs = Needs(runs, spec)
    plot = Plot("train_reward", "Training reward against on-policy trajectories and wall clock", missing=needs.missing)
    df = _train_frames(needs, arms)
    if df is None:
        return plot
    df["arm"] = df["arm"].map({r.label: _label(r) for r in arms})
    mean = (df.groupby(["arm", "step"], sort=False)[["cum_trajectories", "cum_wall_s", "reward_mean"]].mean()
            .reset_index())
    scale, unit = _time_unit(mean["cum_wall_s"].max())
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2, sharey=True)
    for arm, d in mean.groupby("arm", sort=False):
        window = max(1, len(d) // 10)   # a running mean over a tenth of training: single updates are noisy
        smooth = 100 * d.reward_mean.rolling(window, min_periods=1).mean()
        left.plot(d.cum_trajectories, smooth, label=arm)
        right.plot(d.cum_wall_s / scale, smooth, label=arm)
    left.set(xlabel="on-policy trajectories", ylabel="training reward (%, running mean)")
    right.set(xlabel=f"training wall clock ({unit})")
    left.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    plot.files = _save(fig, out, plot.name)
    return plot


def ablations(runs: Runs, out: Path) -> Plot:
    tables = {f: ablation_table(runs, f) for f in FACTORS}
    plot = Plot("ablations", "Ablations: fork budget, selector, horizon, proposal temperature",
                missing=[m for t in tables.values() for m in t.missing])
    if all(t.data is None or t.data["train_runs"].sum() == 0 for t in tables.values()):
        return plot
    use_eval = any(t.data is not None and t.data["pass_at_1"].notna().any() for t in tables.values())
    y, err, ylabel = ("pass_at_1", "std", "pass@1 (%)") if use_eval else \
        ("train_reward", "train_reward_std", "training reward (%)")
    if not use_eval:
        plot.notes.append("no evaluations of the ablation runs yet: the panels show the training reward")
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2).ravel()
    for ax, (letter, (factor, table)) in zip(axes, zip("abcd", tables.items())):
        ax.set_title(f"({letter}) {FACTORS[factor][1]}")
        d = None if table.data is None else table.data[table.data["train_runs"] > 0]
        if d is None or d.empty:
            ax.text(0.5, 0.5, "no runs yet", ha="center", va="center", transform=ax.transAxes)
            continue
        labels = [str(v) for v in d.value]
        yerr = d[err].fillna(0).to_numpy()
        if factor == "selector":
            ax.bar(labels, d[y], yerr=yerr, color=["C1" if x else "C0" for x in d.default], capsize=3)
            ax.tick_params(axis="x", labelrotation=20)
        else:
            xs = [0.0 if str(v).startswith("0 (") else v for v in d.value] if factor != "horizon" else range(len(d))
            ax.errorbar(list(xs), d[y], yerr=yerr, marker="o", capsize=3)
            if factor == "horizon":
                ax.set_xticks(list(xs), labels)
            if factor == "k" and d["relative_wall"].notna().any():
                twin = ax.twinx()
                twin.plot(list(xs), d["relative_wall"], color="C3", linestyle="--", marker="s")
                twin.set_ylabel("wall clock relative to default", color="C3")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    plot.files = _save(fig, out, plot.name)
    return plot


def snr(runs: Runs, out: Path) -> Plot:
    spec = _main_spec(runs)
    needs = Needs(runs, spec)
    arms, crr = main_arms(runs, spec)
    plot = Plot("snr", "Advantage SNR and bucket covariance over training", missing=needs.missing)
    df = _train_frames(needs, arms)
    if df is None:
        return plot
    labels = {r.label: _label(r) for r in arms}
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2)
    for arm, d in df.dropna(subset=["advantage_snr"]).groupby("arm", sort=False):
        m = d.groupby("step")["advantage_snr"].mean()
        left.plot(m.index, m.values, marker=".", label=labels.get(arm, arm))
    left.set(xlabel="optimizer update", ylabel="advantage SNR  mean|A*| / std(A*)")
    if left.get_legend_handles_labels()[0]:
        left.legend()
    else:
        left.text(0.5, 0.5, "no advantage SNR recorded\n(every advantage was 0)", ha="center", va="center",
                  transform=left.transAxes)
    cov = df[df["arm"] == (crr.label if crr else None)].dropna(subset=["cov"])
    if not cov.empty:
        m = cov.groupby("step")[["cov", "cov_p5", "cov_p95"]].mean()
        right.plot(m.index, m["cov"], marker=".", color="C2", label="CRR mean")
        right.fill_between(m.index, m["cov_p5"], m["cov_p95"], color="C2", alpha=0.2, label="5th-95th pct. of buckets")
        right.legend()
    else:
        right.text(0.5, 0.5, "no covariance recorded\n(a bucket needs two pairs)", ha="center", va="center",
                   transform=right.transAxes)
    right.set(xlabel="optimizer update", ylabel="bucket Cov(R(τ), R(τ̃) | B)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    plot.files = _save(fig, out, plot.name)
    return plot


def per_repo(runs: Runs, out: Path) -> Plot:
    table = per_repo_table(runs)
    plot = Plot("per_repo", "Per-repository pass@1", missing=table.missing)
    if table.data is None:
        return plot
    wide = table.data.groupby(["repo", "arm"], sort=False)["pass_at_1"].mean().unstack("arm")
    fig = Figure(figsize=(max(6, 0.9 * len(wide)), 3.8))
    ax = fig.subplots()
    width = 0.8 / max(1, wide.shape[1])
    for i, arm in enumerate(wide.columns):
        ax.bar(np.arange(len(wide)) + i * width, wide[arm].fillna(0), width, label=arm)
    ax.set_xticks(np.arange(len(wide)) + 0.4 - width / 2, wide.index, rotation=30, ha="right")
    ax.set_ylabel("pass@1 (%)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    plot.files = _save(fig, out, plot.name)
    return plot


def all_plots(runs: Runs, out: Path) -> list[Plot]:
    return [make(runs, out) for make in (sample_efficiency, train_reward, ablations, snr, per_repo)]
