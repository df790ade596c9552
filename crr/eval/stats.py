"""The statistics a reviewer expects of a pass rate and of a comparison between two arms: a Wilson interval on
a rate, a paired bootstrap interval of a difference over tasks (and seeds), and the smallest difference a design
resolves at a given power.

    wilson(0.375, 64)                            # (0.267, 0.497): 24 of 64 tasks
    compare(crr, grpo)                           # crr, grpo: (seeds, tasks) arrays of per-task success rates
    minimum_detectable(compare(crr, grpo).components, tasks=256, seeds=8)

The unit of independence is the task: a model's samples of one task, and several seeds' models on the same tasks,
are not independent draws. So a rate's Wilson interval counts its tasks (n = instances), and a comparison pairs
the two arms task by task. scipy and statsmodels are not installed (the venv is shared and these are a few
lines): the normal quantiles come from the standard library's statistics.NormalDist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from crr.errors import CRRError

CONFIDENCE = 0.95
POWER = 0.80
BOOTSTRAP = 10_000          # replicates of a paired bootstrap
BOOTSTRAP_SEED = 0          # a fixed RNG seed: the same runs give the same report


def z(q: float) -> float:
    """The standard normal quantile at q."""
    return NormalDist().inv_cdf(q)


def wilson(rate: float | None, n: int, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion `rate` observed over `n` independent units (Wilson 1927):
    (p + z^2/2n -/+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n). A rate that is a mean of per-unit fractions
    (sampled pass@1, the unbiased pass@k) takes the same formula with n = the units averaged over. None when
    there is no rate or no unit."""
    if rate is None or n < 1 or (isinstance(rate, float) and math.isnan(rate)):
        return None
    if not 0.0 <= rate <= 1.0:
        raise CRRError(f"a Wilson interval needs a rate in [0, 1], got {rate}")
    q = z(0.5 + confidence / 2)
    centre = (rate + q * q / (2 * n)) / (1 + q * q / n)
    half = q * math.sqrt(rate * (1 - rate) / n + q * q / (4 * n * n)) / (1 + q * q / n)
    # at 0 and 1 the bound is exactly the rate (the formula's rounding leaves ~1e-17)
    return (0.0 if rate == 0 else max(0.0, centre - half)), (1.0 if rate == 1 else min(1.0, centre + half))


@dataclass
class Components:
    """Variance components of a paired comparison (rate units squared; crossed tasks x seeds, random)."""
    task: float          # sigma_tau^2: between tasks, of the arms' true per-task difference
    residual_a: float    # sigma_e^2 of arm A: a task's outcome from one seed's model to the next, seed effects removed
    residual_b: float
    seed_a: float        # sigma_alpha^2 of arm A: a whole seed's model above or below the arm's mean
    seed_b: float

    def variance(self, tasks: int, seeds_a: int, seeds_b: int) -> float:
        """Var(D) for a design of `tasks` tasks and these seeds per arm."""
        return ((self.task + self.residual_a / seeds_a + self.residual_b / seeds_b) / tasks
                + self.seed_a / seeds_a + self.seed_b / seeds_b)


@dataclass
class Comparison:
    """A minus B over the tasks both arms were evaluated on, in rate units (x 100 for points)."""
    tasks: int
    seeds_a: int
    seeds_b: int
    diff: float                              # mean over tasks of (A's seed mean - B's seed mean)
    ci_tasks: tuple[float, float]            # paired bootstrap over tasks, the seeds' models fixed
    ci_tasks_seeds: tuple[float, float]      # paired bootstrap over tasks and, within each arm, seeds
    a_ahead: int                             # tasks A solves more often than B (one seed each: A solves, B not)
    b_ahead: int
    components: Components
    mde: float                               # the smallest difference this design resolves (POWER, CONFIDENCE)


def _two_way(x: np.ndarray) -> tuple[float, float] | None:
    """(sigma_alpha^2, sigma_e^2) of a (seeds, tasks) array from its two-way ANOVA mean squares (seeds and
    tasks crossed, random): E[MS_res] = sigma_e^2, E[MS_seed] = sigma_e^2 + T sigma_alpha^2. None below two seeds."""
    s, t = x.shape
    if s < 2:
        return None
    rows, cols, grand = x.mean(1), x.mean(0), x.mean()
    ms_seed = t * float(((rows - grand) ** 2).sum()) / (s - 1)
    ms_res = float(((x - rows[:, None] - cols[None, :] + grand) ** 2).sum()) / ((s - 1) * (t - 1))
    return max(0.0, (ms_seed - ms_res) / t), ms_res


def compare(a, b, *, replicates: int = BOOTSTRAP, seed: int = BOOTSTRAP_SEED,
            confidence: float = CONFIDENCE, power: float = POWER, fixed_b: bool = False) -> Comparison:
    """Paired comparison of arm A with arm B. `a` and `b` are (seeds, tasks) arrays of per-task success rates
    (1/0 for a greedy evaluation, c/n for n samples), one row per seed's model, the same tasks in the same
    columns; the arms' seeds need not match (each arm's seed mean is compared).

    The difference is D = mean_t d_t, d_t = mean_s a[s, t] - mean_s b[s, t]. Its confidence intervals are
    percentile intervals of a paired bootstrap with a fixed RNG seed: over tasks (the same resampled tasks for
    both arms, each arm's seeds kept), and over tasks and seeds (the tasks as before and, in each arm
    independently, its seeds' models resampled with replacement).

    The power line. Each arm is a crossed tasks x seeds design, a[s, t] = mu + alpha_s + tau_t + e_st (a seed's
    model as a whole better or worse, tasks easier or harder, the rest); the arms share the tasks. Per arm, its
    two-way ANOVA gives sigma_alpha^2 = max(0, (MS_seed - MS_res) / T) and sigma_e^2 = MS_res (an arm of one
    seed takes the other arm's). Then
        Var(D) = var_t(d_t) / T + sigma_alpha,A^2 / S_A + sigma_alpha,B^2 / S_B
    (var_t(d_t), ddof 1, holds the task-by-task spread of the difference and the e's; a seed effect is the same
    on every task, so it enters through the seeds alone), and the smallest difference a two-sided test at level
    alpha = 1 - confidence detects with the given power is
        MDE = (z_{1 - alpha/2} + z_power) sqrt(Var(D))        (2.80 standard errors at alpha 0.05, 80 % power).
    For another design, Components.variance(T, S_A, S_B) with sigma_tau^2 = max(0, var_t(d_t) - sigma_e,A^2 /
    S_A - sigma_e,B^2 / S_B): `minimum_detectable`, `seeds_needed`.

    fixed_b: B is one fixed model, not a draw of a trained arm (the starting policy that every arm trains
    from), so it has no seed-to-seed variance: sigma_alpha,B^2 = 0 (b holds one row)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or a.shape[1] < 2 or not len(a) or not len(b):
        raise CRRError(f"a paired comparison needs (seeds, tasks) arrays over the same two or more tasks, got "
                       f"{a.shape} and {b.shape}")
    (sa, t), sb = a.shape, b.shape[0]
    d = a.mean(0) - b.mean(0)
    rng = np.random.default_rng(seed)
    tasks = rng.integers(0, t, size=(replicates, t))
    fixed = d[tasks].mean(1)
    ra = a[rng.integers(0, sa, size=(replicates, sa))].mean(1)        # (replicates, tasks): resampled seed means
    rb = b[rng.integers(0, sb, size=(replicates, sb))].mean(1)
    both = np.take_along_axis(ra - rb, tasks, axis=1).mean(1)
    tail = 100 * (1 - confidence) / 2
    if fixed_b and sb != 1:
        raise CRRError(f"a fixed model B is one row of per-task rates, got {sb}")
    ca, cb = _two_way(a), _two_way(b)
    ca, cb = (ca or cb or (0.0, 0.0)), (cb or ca or (0.0, 0.0))
    if fixed_b:   # its per-task spread (and, sampled, its sampling noise) lies in var_t(d_t) already
        cb = (0.0, 0.0)
    total = float(d.var(ddof=1))
    comp = Components(task=max(0.0, total - ca[1] / sa - cb[1] / sb), residual_a=ca[1], residual_b=cb[1],
                      seed_a=ca[0], seed_b=cb[0])
    return Comparison(
        tasks=t, seeds_a=sa, seeds_b=sb, diff=float(d.mean()),
        ci_tasks=tuple(float(x) for x in np.percentile(fixed, [tail, 100 - tail])),
        ci_tasks_seeds=tuple(float(x) for x in np.percentile(both, [tail, 100 - tail])),
        a_ahead=int((d > 0).sum()), b_ahead=int((d < 0).sum()), components=comp,
        mde=_k(confidence, power) * math.sqrt(total / t + ca[0] / sa + cb[0] / sb))


def _k(confidence: float, power: float) -> float:
    return z(1 - (1 - confidence) / 2) + z(power)


def minimum_detectable(components: Components, tasks: int, seeds: int,
                       confidence: float = CONFIDENCE, power: float = POWER) -> float:
    """The MDE of `compare` for a design of `tasks` tasks and `seeds` seeds in each arm."""
    if tasks < 1 or seeds < 1:
        raise CRRError(f"a design needs at least one task and one seed, got {tasks} tasks and {seeds} seeds")
    return _k(confidence, power) * math.sqrt(components.variance(tasks, seeds, seeds))


def seeds_needed(components: Components, tasks: int, target: float, most: int = 1000,
                 confidence: float = CONFIDENCE, power: float = POWER) -> int | None:
    """The fewest seeds per arm at which `minimum_detectable` on `tasks` tasks is at most `target`; None when
    not even `most` seeds reach it (the tasks' own spread is too wide: more tasks are needed)."""
    if target <= 0:
        raise CRRError(f"a target difference must be positive, got {target}")
    return next((s for s in range(1, most + 1)
                 if minimum_detectable(components, tasks, s, confidence, power) <= target), None)
