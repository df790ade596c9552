"""pass@k, all-n and per-repository pass@1 over an evaluation's scored samples (paper: Experiments,
greedy pass@1; Supplementary "Multiple-sample evaluation": sampled pass@1, pass@2/4/8 and all-8).

    pass_at_k(n=8, c=3, k=4)                  # 1 - C(5, 4) / C(8, 4) = 13/14
    summarise_samples(records, instances, samples=8)

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of an instance of which c pass,
the chance that k drawn without replacement include a pass, averaged over instances. An infrastructure
failure (reward None) is not a sample: an instance's n counts its scored samples only, and pass@k uses
the instances with at least k of them. all-n is the fraction of instances whose n samples all pass
(instances with all n scored).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from crr.errors import CRRError

KS = (1, 2, 4, 8)  # the paper's pass@k columns


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k) for one instance, exactly (integer binomials; n is small)."""
    if not 0 <= c <= n:
        raise CRRError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise CRRError(f"pass@{k} needs 1 <= k <= n samples, got n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


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
    """pass@1, pass@k (k in KS, k <= samples), all-n and per-repository pass@1 of the records, over the
    evaluation's `instances` (instance_id -> repo; an instance with no scored sample is left out of the
    rates but counted in n_instances)."""
    counts = instance_counts(r for r in records if r["instance_id"] in instances)
    pass_k = {str(k): _mean([pass_at_k(n, c, k) for n, c in counts.values() if n >= k]) for k in KS if k <= samples}
    per_repo: dict[str, dict] = {}
    for repo in sorted(set(instances.values())):
        ids = [i for i, r in instances.items() if r == repo]
        per_repo[repo] = {"instances": len(ids),
                          "pass_at_1": _mean([counts[i][1] / counts[i][0] for i in ids if i in counts])}
    scored = sum(n for n, _ in counts.values())
    return {
        "n_instances": len(instances),
        "scored": scored,
        "infra_errors": sum(r["reward"] is None for r in records if r["instance_id"] in instances),
        "pass_at_1": _mean([c / n for n, c in counts.values()]),
        "pass_at_k": pass_k,
        "all_n": _mean([float(c == n) for n, c in counts.values() if n == samples]),
        "per_repo": per_repo,
    }
