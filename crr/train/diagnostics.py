"""Signal diagnostics (paper: Appendix "Empirical Correlation Diagnostics").

advantage_snr      mean |A*_t| over the standard deviation of A*_t across the rollout pool (every step of
                   every trained row).
bucket_covariance  Cov(R(tau), R(tilde tau) | B) within buckets B = (task id, selected-step decile,
                   prefix signature), averaged over buckets weighted by their size. A bucket needs two
                   pairs to have a covariance; singletons are left out (the count says how many pairs
                   were used).
prefix_signature   the first ten semantic tokens of the realised action history before t: the tool names
                   and argument values, split into words (the JSON structure is not semantic).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

_WORD = re.compile(r"\w+")


def advantage_snr(step_advantages: Sequence[Sequence[float]]) -> float | None:
    values = np.array([a for row in step_advantages for a in row], dtype=float)
    if values.size < 2 or values.std() == 0:
        return None
    return float(np.abs(values).mean() / values.std())


def prefix_signature(calls: Sequence[dict | None], n: int = 10) -> str:
    words: list[str] = []
    for call in calls:
        if call is None:
            words.append("<invalid>")
            continue
        words.append(call["name"])
        for value in call["arguments"].values():
            words.extend(_WORD.findall(str(value)))
    return " ".join(words[:n])


def decile(t: int, steps: int) -> int:
    return min(9, math.floor(10 * t / max(steps, 1)))


def bucket_covariance(tuples: pd.DataFrame) -> dict:
    """Weighted mean within-bucket covariance of (reward, cf_reward) over the scored tuples."""
    df = tuples.dropna(subset=["reward", "cf_reward"])
    if df.empty:
        return {"cov": None, "pairs": 0, "buckets": 0}
    keys = [df["task_id"], [decile(t, n) for t, n in zip(df["t"], df["steps"])], df["prefix_signature"]]
    covs, weights = [], []
    for _, b in df.groupby(keys):
        if len(b) >= 2:
            covs.append(float(np.cov(b["reward"], b["cf_reward"], ddof=0)[0, 1]))
            weights.append(len(b))
    if not covs:
        return {"cov": None, "pairs": 0, "buckets": 0}
    return {"cov": float(np.average(covs, weights=weights)), "pairs": int(sum(weights)), "buckets": len(covs),
            "cov_p5": float(np.percentile(covs, 5)), "cov_p95": float(np.percentile(covs, 95))}
