"""pass@k, pass^k, all-n and per-repository pass@1 over an evaluation's scored samples (paper: Experiments,
greedy pass@1; Supplementary "Multiple-sample evaluation": sampled pass@1, pass@2/4/8 and all-8), each rate with
its Wilson interval (crr.eval.stats).

    pass_at_k(n=8, c=3, k=4)                  # 1 - C(5, 4) / C(8, 4) = 13/14
    pass_hat_k(n=8, c=3, k=2)                 # C(3, 2) / C(8, 2) = 3/28
    summarise_samples(records, instances, samples=8)

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of an instance of which c pass,
the chance that k drawn without replacement include a pass, averaged over instances. An infrastructure
failure (reward None) is not a sample: an instance's n counts its scored samples only, and pass@k uses
the instances with at least k of them. pass^k (Yao et al. 2024, tau-bench) is the chance that k samples
drawn without replacement all pass, C(c, k) / C(n, k), averaged the same way: how reliably a task is solved
where pass@k says whether it can be. all-n is the fraction of instances whose n samples all pass (instances
with all n scored; pass^n). A rate's interval is Wilson's over the instances it averages (`*_ci`, [low, high]).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from crr.errors import CRRError
from crr.eval.stats import wilson

KS = (1, 2, 4, 8)  # the paper's pass@k columns


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) for one instance, exactly (integer binomials; n is small)."""
    if not 0 <= c <= n:
        raise CRRError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise CRRError(f"pass@{k} needs 1 <= k <= n samples, got n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k) for one instance: k samples drawn without replacement all pass."""
    if not 0 <= c <= n:
        raise CRRError(f"pass^k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise CRRError(f"pass^{k} needs 1 <= k <= n samples, got n={n}")
    return math.comb(c, k) / math.comb(n, k)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(values: list[float]) -> tuple[float | None, list[float] | None]:
    """The mean of per-instance values and its Wilson interval over those instances."""
    rate = _mean(values)
    ci = wilson(rate, len(values))
    return rate, None if ci is None else list(ci)


def instance_counts(records: Iterable[dict]) -> dict[str, tuple[int, int]]:
    """instance_id -> (n scored samples, c passing) from result records (one per instance and sample);
    an instance with no scored sample has no entry."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        if r["reward"] is not None:
            counts[r["instance_id"]][0] += 1
            counts[r["instance_id"]][1] += r["reward"] == 1.0
    return {iid: (n, c) for iid, (n, c) in counts.items()}


def summarise_samples(records: list[dict], instances: dict[str, str], samples: int) -> dict:
    """pass@1, pass@k and pass^k (k in KS, k <= samples), all-n and per-repository pass@1 of the records, each
    with its Wilson interval, over the evaluation's `instances` (instance_id -> repo; an instance with no
    scored sample is left out of the rates but counted in n_instances)."""
    counts = instance_counts(r for r in records if r["instance_id"] in instances)
    ks = [k for k in KS if k <= samples]
    at_k = {str(k): _rate([pass_at_k(n, c, k) for n, c in counts.values() if n >= k]) for k in ks}
    hat_k = {str(k): _rate([pass_hat_k(n, c, k) for n, c in counts.values() if n >= k]) for k in ks}
    per_repo: dict[str, dict] = {}
    for repo in sorted(set(instances.values())):
        ids = [i for i, r in instances.items() if r == repo]
        rate, ci = _rate([counts[i][1] / counts[i][0] for i in ids if i in counts])
        per_repo[repo] = {"instances": len(ids), "pass_at_1": rate, "pass_at_1_ci": ci}
    scored = sum(n for n, _ in counts.values())
    pass_1, pass_1_ci = _rate([c / n for n, c in counts.values()])
    all_n, all_n_ci = _rate([float(c == n) for n, c in counts.values() if n == samples])
    return {
        "n_instances": len(instances),
        "scored": scored,
        "infra_errors": sum(r["reward"] is None for r in records if r["instance_id"] in instances),
        "pass_at_1": pass_1,
        "pass_at_1_ci": pass_1_ci,
        "pass_at_k": {k: v for k, (v, _) in at_k.items()},
        "pass_at_k_ci": {k: ci for k, (_, ci) in at_k.items()},
        "pass_hat_k": {k: v for k, (v, _) in hat_k.items()},
        "pass_hat_k_ci": {k: ci for k, (_, ci) in hat_k.items()},
        "all_n": all_n,
        "all_n_ci": all_n_ci,
        "per_repo": per_repo,
    }
