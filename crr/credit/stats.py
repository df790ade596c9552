"""The audit's statistics: intervals of V(s_t) and A*(t), and how well an estimator tracks A*.

No scipy in crr's environment, so two textbook formulas are written here (each a few lines; Wilson's score
interval of a proportion is crr.eval.stats.wilson): Newcombe's hybrid score interval for a difference of two
independent proportions (Newcombe 1998, method 10: the one statsmodels calls "newcomb"), and Spearman's rho as
Pearson's r of average ranks (pandas' rank).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from crr.eval.stats import wilson


def newcombe(p1: float, ci1: tuple[float, float], p2: float, ci2: tuple[float, float]) -> tuple[float, float]:
    """Newcombe's interval of p1 - p2 from the two proportions' Wilson intervals. An exact proportion (V(s_T)
    = R(tau)) enters with the zero-width interval (p, p)."""
    (l1, u1), (l2, u2) = ci1, ci2
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def values(continuations: list[list[float | None]], reward: float) -> list[dict]:
    """Per step t of a trajectory with return `reward`, from the scored returns of its on-policy
    continuations from s_t: V(s_t) (mean), its Wilson interval and n; then A*(t) = V(s_{t+1}) - V(s_t) with
    V(s_T) = R(tau), and its Newcombe interval. A step whose state or successor has no scored continuation
    gets None for what depends on it."""
    v = []
    for returns in continuations:
        scored = [r for r in returns if r is not None]
        v.append(None if not scored else (sum(scored) / len(scored), wilson(sum(scored) / len(scored), len(scored)),
                                          len(scored)))
    v.append((reward, (reward, reward), 0))   # V(s_T) = R(tau), exact
    out = []
    for t in range(len(continuations)):
        here, nxt = v[t], v[t + 1]
        row = {"V": None, "V_lo": None, "V_hi": None, "V_n": 0, "A": None, "A_lo": None, "A_hi": None}
        if here is not None:
            row.update(V=here[0], V_lo=here[1][0], V_hi=here[1][1], V_n=here[2])
        if here is not None and nxt is not None:
            lo, hi = newcombe(nxt[0], nxt[1], here[0], here[1])
            row.update(A=nxt[0] - here[0], A_lo=lo, A_hi=hi)
        out.append(row)
    return out


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    return _pearson(pd.Series(x).rank().to_numpy(), pd.Series(y).rank().to_numpy())


def _ci(samples: list[float]) -> tuple[float, float]:
    s = [x for x in samples if not math.isnan(x)]
    return (math.nan, math.nan) if len(s) < 2 else (float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5)))


def estimator_metrics(steps: pd.DataFrame, grpo: pd.Series | None, *, boot: int = 1000, seed: int = 0) -> dict:
    """How one estimator's advantages track A*, over the steps of `steps` (columns traj, repeat, t, a (the
    estimate), A, A_lo, A_hi; one row per step and repeat of the estimator's random draws):

    pearson, spearman    over all (step, repeat) pairs, with a 95 % bootstrap interval over trajectories
    sign_agreement       on steps whose A* interval excludes 0: the share where sign(a) = sign(A*) (a = 0
                         disagrees), and n_significant, how many such steps
    mse = bias2 + variance   bias2: mean over steps of (mean over repeats of a - A*)^2; variance: mean over
                         steps of the repeats' variance (ddof 0, so that the two add up to the MSE exactly)
    differs_from_grpo    share of (step, repeat) pairs where a != GRPO's advantage (`grpo`, aligned)
    pearson_vs_grpo      pearson minus GRPO's on the same pairs, with a paired 95 % bootstrap interval (the
                         same resampled trajectories for both)
    """
    a, star = steps["a"].to_numpy(float), steps["A"].to_numpy(float)
    out = {"steps": int(steps.groupby(["traj", "t"]).ngroups), "pearson": _pearson(a, star),
           "spearman": _spearman(a, star)}
    if grpo is not None:
        steps = steps.assign(grpo=grpo.to_numpy(float))
        out["pearson_vs_grpo"] = out["pearson"] - _pearson(steps["grpo"].to_numpy(float), star)
    trajs = steps["traj"].unique()
    rng = np.random.default_rng(seed)
    rows_of = steps.reset_index(drop=True).groupby("traj").indices   # a trajectory's rows, in order
    g = steps["grpo"].to_numpy(float) if grpo is not None else None
    pear, spear, diff = [], [], []
    for _ in range(boot if len(trajs) > 1 else 0):
        rows = np.concatenate([rows_of[k] for k in rng.choice(trajs, size=len(trajs))])
        x, y = a[rows], star[rows]
        pear.append(_pearson(x, y))
        spear.append(_spearman(x, y))
        if g is not None:
            diff.append(pear[-1] - _pearson(g[rows], y))
    out["pearson_lo"], out["pearson_hi"] = _ci(pear)
    out["spearman_lo"], out["spearman_hi"] = _ci(spear)
    if grpo is not None:
        out["pearson_vs_grpo_lo"], out["pearson_vs_grpo_hi"] = _ci(diff)
    significant = steps[(steps["A_lo"] > 0) | (steps["A_hi"] < 0)]
    out["n_significant"] = int(significant.groupby(["traj", "t"]).ngroups)
    out["sign_agreement"] = (float((np.sign(significant["a"]) == np.sign(significant["A"])).mean())
                             if len(significant) else math.nan)
    per_step = steps.groupby(["traj", "t"]).agg(mean=("a", "mean"), var=("a", lambda s: float(np.var(s))),
                                                A=("A", "first"))
    out["bias2"] = float(((per_step["mean"] - per_step["A"]) ** 2).mean())
    out["variance"] = float(per_step["var"].mean())
    out["mse"] = out["bias2"] + out["variance"]
    out["differs_from_grpo"] = (float((np.abs(a - grpo.to_numpy(float)) > 1e-9).mean())
                                if grpo is not None else math.nan)
    return out
