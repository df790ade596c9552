"""Benchmark for the report (not a timed test): iteration wall time of crr / grpo at k=4, K=1 (the override
cf_samples=K sets another) on the CPU preset, and the fork share of a CRR iteration (paper: 1.71x microbatch
latency; targets <= 1.6x and <= 5 %);
CRR twice: its forks after the rollout (the default) and started during it (forks_during_rollout=true,
crr.train.counterfactual.LiveForks; --no-live leaves it out); --horizon h adds CRR with its branches truncated at
h steps after a_t (the paper's horizon ablation: the verifier scores the working tree where the branch stops).

    [OMP_NUM_THREADS=1] .venv/bin/python scripts/train_bench.py --updates 3 [--config PRESET] [--horizon H]
        [--no-live] [--fixed-policy] [--repeat N] [key=value ...]

Runs `crr train` for each method with the same seed and config into a temporary directory and reads the
ledgers: mean iteration wall_s and phase seconds per method, their ratio, the fork share fork_s / wall_s
(snapshot, restore and materialisation) and the counterfactual share (fork_s + cf_rollout_s + cf_test_s) / wall_s;
the seconds per on-policy trajectory (rollout_s / trajectories) and per branch ((fork_s + cf_rollout_s +
cf_test_s) / forks: the forks the selector kept, those a sibling played included (forks_reused); the discarded
live forks' seconds are in the numerator; with branches_beside_update what the branches added to the wall clock,
and s_per_branch_own with the seconds they ran beside the update, cf_beside_s; branch_own_over_trajectory their
ratio), the tokens new to each (generated_per_trajectory, generated_per_branch, observed_per_...: the ledger's
counts; a branch's prefix is its parent's, so its suffix is what is new) and their ratios
(branch_over_trajectory_generated, _observed), what a branch's seconds compare with, the test runs the verdicts by
final state spared (verdicts_reused;
reuse_verdicts=false reuse_played=false measure without either), and
CRR/GRPO also without the learner update (the same rows in both: on a shared machine its seconds are the
noisiest part) and by the counterfactual share, 1 / (1 - cf_share): CRR's iteration over the same iteration
without its counterfactual work, which is GRPO's iteration when both play the same trajectories (with
branches_beside_update, the default, the share holds only the wait for the branches at the join, not the update's
slow-down beside them: then the ratio as measured prices CRR; branches_beside_update=false measures the branches
before the update). They do with --fixed-policy (learning_rate=1e-12: the policy stays as it starts), so that the ratio
measures what CRR adds and not where two trained policies drift (longer or shorter episodes); all but the
forks-during-rollout arm, whose branches share the rollout's generation calls and so change its rows' draws (the same
distribution, other samples). Each ratio carries a 95 % bootstrap interval over the run's updates (`*_ci95`; the arms'
iterations paired by update, which with --fixed-policy play the same trajectories): how far the one run's figure moves
with its updates' noise, mostly the learner update's. The result records torch's intra-op threads (`intra_op_threads`):
with one (OMP_NUM_THREADS=1, as `make main` runs) the update leaves the second core of a 2-core machine to the branches
beside it, and every iteration is slower.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import torch

from crr.eval.stats import BOOTSTRAP, BOOTSTRAP_SEED, CONFIDENCE
from crr.train.config import load_config, parse_overrides
from crr.train.ledger import CF_PHASES, PHASES
from crr.train.trainer import start_run, train


def interval(statistic, *series: list[float]) -> list[float]:
    """The bootstrap interval (CONFIDENCE) of statistic(*sums) over the updates, each series summed over the same
    resampled updates."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    arrays = [np.asarray(x, dtype=float) for x in series]
    draws = rng.integers(0, len(arrays[0]), size=(BOOTSTRAP, len(arrays[0])))
    values = statistic(*(a[draws].sum(axis=1) for a in arrays))
    return np.quantile(values, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]).round(3).tolist()


def new_tokens(its: list[dict]) -> dict:
    """The tokens new to each on-policy trajectory and to each branch, from one arm's ledger iterations: those the
    policy generated and those it was fed (observed: a trajectory's task prompt, shared by its siblings, and its
    observations). A branch's prefix is its parent's, so what is new in it is its suffix: a_t~, the calls after
    it and their observations. Kept apart, since on a CPU a generated token costs a decoding pass's share and an
    observed one a prefill's, several times less."""
    total = {k: sum(i.get(k, 0) for i in its) for k in ("generated_tokens_on_policy", "generated_tokens_all",
                                                         "observed_tokens_on_policy", "observed_tokens_all")}
    trajectories, forks = max(sum(i["trajectories"] for i in its), 1), max(sum(i["forks"] for i in its), 1)
    return {f"{kind}_per_{unit}": value / (trajectories if unit == "trajectory" else forks)
            for kind in ("generated", "observed") for unit, value in
            (("trajectory", total[f"{kind}_tokens_on_policy"]),
             ("branch", total[f"{kind}_tokens_all"] - total[f"{kind}_tokens_on_policy"]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--config", default=None, help="a preset (experiments/*.yaml); default: crr's defaults")
    ap.add_argument("--horizon", type=int, action="append", default=[],
                    help="also CRR with its branches truncated at h steps after a_t (repeatable)")
    ap.add_argument("--no-live", action="store_true", help="leave out the forks-during-rollout arm")
    ap.add_argument("--fixed-policy", action="store_true",
                    help="learning_rate=1e-12: the policy stays as it starts, so the arms play the same "
                         "trajectories (the forks-during-rollout arm other draws of them)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the arms this many times in turn and pool their updates (paired by run and update)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="crr-train-bench-")
    result, series = {}, {}   # series: each arm's per-update seconds, for the intervals
    arms = {"grpo": {"method": "grpo"}, "crr": {"method": "crr"},
            **({} if args.no_live else {"crr_forks_during_rollout": {"method": "crr", "forks_during_rollout": True}}),
            **{f"crr_horizon_{h}": {"method": "crr", "horizon": h} for h in args.horizon}}
    ledgers: dict[str, list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.repeat):   # the arms in turn, so that a slow spell of a shared machine falls on all of them
        for arm, settings in arms.items():
            fixed = {"learning_rate": 1e-12} if args.fixed_policy else {}
            cfg = load_config(args.config, {"cf_samples": 1, **parse_overrides(args.overrides), **fixed, **settings,
                                            "k": 4, "max_steps": args.updates, "output_dir": out})
            run = start_run(cfg, out)
            train(cfg, run)
            ledgers[arm] += json.loads((run.path / "ledger.json").read_text())["iterations"]
    for arm, its in ledgers.items():
        cf = [sum(i[k] for k in CF_PHASES) for i in its]   # what the counterfactual work added to each iteration
        wall = sum(i["wall_s"] for i in its) / len(its)
        total = sum(i["wall_s"] for i in its)
        series[arm] = {"wall": [i["wall_s"] for i in its], "update": [i["update_s"] for i in its],
                       "cf": cf}
        result[arm] = {"iteration_wall_s": wall, "forks": sum(i["forks"] for i in its),
                       "forks_discarded": sum(i.get("forks_discarded", 0) for i in its),
                       "forks_reused": sum(i.get("forks_reused", 0) for i in its),
                       "verdicts_reused": sum(i.get("verdicts_reused", 0) for i in its),
                       "trajectories": sum(i["trajectories"] for i in its),
                       **{k: sum(i[k] for i in its) / len(its) for k in PHASES},
                       "fork_share": sum(i["fork_s"] for i in its) / total,
                       "cf_share": sum(cf) / total,
                       "s_per_trajectory": sum(i["rollout_s"] for i in its) / sum(i["trajectories"] for i in its),
                       "s_per_branch": sum(cf) / max(sum(i["forks"] for i in its), 1),
                       "s_per_branch_own": ((sum(cf) + sum(i["cf_beside_s"] for i in its))
                                            / max(sum(i["forks"] for i in its), 1)),
                       **new_tokens(its)}
    grpo = result["grpo"]
    for arm in (a for a in arms if a != "grpo"):
        crr = result[arm]
        result[arm]["over_grpo"] = crr["iteration_wall_s"] / grpo["iteration_wall_s"]
        result[arm]["over_grpo_without_update"] = ((crr["iteration_wall_s"] - crr["update_s"])
                                                   / (grpo["iteration_wall_s"] - grpo["update_s"]))
        result[arm]["branch_over_trajectory"] = crr["s_per_branch"] / crr["s_per_trajectory"]
        result[arm]["branch_own_over_trajectory"] = crr["s_per_branch_own"] / crr["s_per_trajectory"]
        for kind in ("generated", "observed"):   # how long a branch is beside a trajectory, in each kind of token
            result[arm][f"branch_over_trajectory_{kind}"] = (crr[f"{kind}_per_branch"]
                                                             / max(crr[f"{kind}_per_trajectory"], 1e-9))
        result[arm]["over_grpo_by_share"] = 1 / (1 - crr["cf_share"])
        c, g = series[arm], series["grpo"]
        result[arm]["over_grpo_ci95"] = interval(lambda cw, gw: cw / gw, c["wall"], g["wall"])
        result[arm]["over_grpo_without_update_ci95"] = interval(lambda cw, cu, gw, gu: (cw - cu) / (gw - gu),
                                                                c["wall"], c["update"], g["wall"], g["update"])
        result[arm]["over_grpo_by_share_ci95"] = interval(lambda cf, cw: 1 / (1 - cf / cw), c["cf"], c["wall"])
    # the ratio depends on it: with one thread (OMP_NUM_THREADS=1) the update leaves a core to the branches
    result["intra_op_threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
