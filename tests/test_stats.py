"""crr.eval.stats against known values and its own definitions: Wilson intervals (published values, coverage),
pass^k, the paired bootstrap (deterministic, paired, wider over seeds) and the power line (its formula, and a
simulation where a difference of the MDE is detected about 80 % of the time); the equal-wall-clock budget rule on
the committed study's ledgers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from crr.errors import CRRError
from crr.eval.passk import pass_at_k, pass_hat_k, summarise_samples
from crr.eval.stats import Components, compare, minimum_detectable, seeds_needed, wilson

ROOT = Path(__file__).resolve().parent.parent


def test_wilson_interval_matches_published_values_and_covers():
    # 24/64 (the shipped default's greedy rate): [26.7 %, 49.7 %]; the textbook 0/10 and 10/10 edges
    lo, hi = wilson(24 / 64, 64)
    assert (round(lo, 4), round(hi, 4)) == (0.2667, 0.4975)
    assert wilson(0.0, 10)[0] == 0.0 and wilson(0.0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(1.0, 10) == (pytest.approx(0.7225, abs=1e-4), 1.0)
    assert wilson(None, 10) is None and wilson(0.5, 0) is None
    with pytest.raises(CRRError, match="rate in"):
        wilson(1.5, 10)
    # coverage near 95 % for a binomial proportion (Wilson's point: not the Wald interval's undercoverage)
    rng = np.random.default_rng(0)
    p, n = 0.3, 64
    hits = [lo <= p <= hi for lo, hi in (wilson(k / n, n) for k in rng.binomial(n, p, 4000))]
    assert 0.93 <= np.mean(hits) <= 0.97


def test_pass_hat_k_and_the_summary_carry_intervals():
    assert pass_hat_k(8, 3, 2) == pytest.approx(3 / 28) and pass_hat_k(4, 4, 4) == 1.0 and pass_hat_k(4, 3, 4) == 0.0
    assert pass_hat_k(5, 2, 1) == pass_at_k(5, 2, 1)          # one sample: the two agree
    with pytest.raises(CRRError):
        pass_hat_k(4, 5, 2)
    # 3 instances x 4 samples: 4/4, 2/4 and 0/4 solved
    records = [{"instance_id": i, "sample": s, "reward": float(s < c)} for i, c in (("a", 4), ("b", 2), ("c", 0))
               for s in range(4)]
    summary = summarise_samples(records, {"a": "r1", "b": "r1", "c": "r2"}, samples=4)
    assert summary["pass_at_1"] == pytest.approx(0.5) and summary["pass_hat_k"]["2"] == pytest.approx((1 + 1 / 6) / 3)
    assert summary["pass_hat_k"]["4"] == pytest.approx(1 / 3) == summary["all_n"]      # pass^n is all-n
    assert summary["pass_at_1_ci"] == pytest.approx(list(wilson(0.5, 3)))               # over the 3 instances
    assert summary["pass_at_k_ci"]["4"] == pytest.approx(list(wilson(2 / 3, 3)))
    assert summary["per_repo"]["r2"]["pass_at_1_ci"] == pytest.approx(list(wilson(0.0, 1)))


def test_paired_comparison_is_deterministic_paired_and_its_power_line_holds():
    rng = np.random.default_rng(1)
    hard = rng.random(64) < 0.4                    # tasks the starting policy solves
    a = np.array([hard | (rng.random(64) < 0.1) for _ in range(3)], dtype=float)
    b = np.array([hard | (rng.random(64) < 0.05) for _ in range(3)], dtype=float)
    c = compare(a, b)
    assert c == compare(a, b)                                        # a fixed RNG seed: the same report
    assert c.diff == pytest.approx(a.mean() - b.mean())
    assert c.ci_tasks[0] <= c.diff <= c.ci_tasks[1]
    assert c.ci_tasks_seeds[1] - c.ci_tasks_seeds[0] >= c.ci_tasks[1] - c.ci_tasks[0]   # seeds add spread
    d = a.mean(0) - b.mean(0)
    assert (c.a_ahead, c.b_ahead) == ((d > 0).sum(), (d < 0).sum())
    # the MDE of the docstring's formula, and the same from the components for this design
    rows = lambda x: x.mean(1)
    ms_res = lambda x: ((x - rows(x)[:, None] - x.mean(0) + x.mean()) ** 2).sum() / (2 * 63)
    seed = lambda x: max(0.0, (64 * rows(x).var(ddof=1) - ms_res(x)) / 64)
    assert c.mde == pytest.approx(2.8016 * math.sqrt(d.var(ddof=1) / 64 + seed(a) / 3 + seed(b) / 3), rel=1e-4)
    # the same design from the components: equal, or above where sigma_tau^2 was clipped at 0
    assert minimum_detectable(c.components, 64, 3) >= c.mde * (1 - 1e-9)
    # pairing: the same difference on shared hard tasks is far tighter paired than the arms' own spreads
    assert c.ci_tasks[1] - c.ci_tasks[0] < 2 * 1.96 * math.sqrt(a.mean(0).var() / 64 + b.mean(0).var() / 64)
    with pytest.raises(CRRError, match="same two or more tasks"):
        compare(a, b[:, :10])
    # against one fixed model (the starting policy): no seed variance on its side, where an ordinary one-seed arm
    # borrows A's; only A's seeds are resampled
    start = hard[None, :].astype(float)
    fixed, borrowed = compare(a, start, fixed_b=True), compare(a, start)
    assert fixed.diff == borrowed.diff and fixed.components.seed_b == 0.0
    assert fixed.mde == pytest.approx(2.8016 * math.sqrt((a.mean(0) - start[0]).var(ddof=1) / 64 + seed(a) / 3),
                                      rel=1e-4)
    assert fixed.mde <= borrowed.mde
    with pytest.raises(CRRError, match="one row"):
        compare(a, b, fixed_b=True)


def test_the_power_line_variance_matches_simulated_designs():
    """Simulate designs with task, seed and residual variation (each seed's model shifted as a whole): the
    comparison's Var(D) (from its MDE) averages to about the variance of D across the simulations, and a
    difference of 2.80 standard deviations is detected about 80 % of the time."""
    rng = np.random.default_rng(7)
    tasks, seeds = 96, 3
    base = rng.uniform(0.1, 0.7, tasks)

    def arm(shift: float) -> np.ndarray:
        p = base + shift + rng.normal(0, 0.04, (seeds, 1))           # a seed effect of 4 points
        return (rng.random((seeds, tasks)) < np.clip(p, 0, 1)).astype(float)

    null = [compare(arm(0.0), arm(0.0), replicates=10) for _ in range(400)]
    empirical = np.var([c.diff for c in null])
    estimated = np.mean([(c.mde / 2.8016) ** 2 for c in null])
    # never anti-conservative; somewhat above it, as a seed component estimated from 3 seeds is truncated at 0
    assert 0.9 * empirical <= estimated <= 1.35 * empirical
    delta = 2.8016 * math.sqrt(empirical)
    hits = np.mean([compare(arm(delta), arm(0.0), replicates=10).diff / math.sqrt(empirical) > 1.96
                    for _ in range(400)])
    assert 0.72 <= hits <= 0.88
    comp = null[0].components
    assert seeds_needed(comp, tasks, minimum_detectable(comp, tasks, seeds)) <= seeds
    assert seeds_needed(Components(1.0, 0, 0, 0, 0), 4, 0.01) is None     # the tasks' spread alone is too wide


def test_equal_wall_clock_budget_stops_at_or_below_it():
    from crr.train.trainer import budget_allows_next

    assert budget_allows_next([], 1.0)                              # the first iteration always runs
    assert budget_allows_next([10.0, 10.0], 30.0) and not budget_allows_next([10.0, 10.0], 29.9)
    assert not budget_allows_next([40.0], 30.0)                     # already past: stop
    # the committed studies' equal-wall-clock runs (the nano study's first overshot its budget by a whole update in
    # every seed under the old rule, stop once the budget is passed): each ran while the rule allowed, and ends at or
    # below its budget unless its last update ran longer than the mean of those before, by no more than that excess
    runs = sorted((ROOT / "results/reference").glob("*-main/runs/grpo-equal-wall-clock/*/ledger.json"))
    assert {p.parents[3].name for p in runs} == {"cpu-main", "multi-main"}
    for ledger in runs:
        times = [it["wall_s"] for it in json.loads(ledger.read_text())["iterations"]]
        budget = yaml.safe_load((ledger.parent / "config.yaml").read_text())["budget_hours"] * 3600
        assert all(budget_allows_next(times[:done], budget) for done in range(len(times))), ledger.parent.name
        assert not budget_allows_next(times, budget), ledger.parent.name
        assert (sum(times) - budget
                <= max(0.0, times[-1] - np.mean(times[:-1]))), (ledger.parent.name, sum(times), budget)
