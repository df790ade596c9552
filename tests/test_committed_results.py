"""Committed results (results/reference/...) and shipped task sets (crr/tasks/sets/...) must read the same on every
clone: no path of the machine that made them (its checkout, home, cache or temporary directories), only paths relative
to the repository; the committed study's report recomputes from its per-task records."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from crr.eval.passk import pass_hat_k
from crr.eval.stats import compare, wilson

ROOT = Path(__file__).resolve().parent.parent
# an absolute path under a directory that names a machine's layout, not the repository
MACHINE_PATH = re.compile(rb"(?<![\w.~-])/(?:work|home|tmp|root|Users|mnt|scratch|var/folders)/[\w.-]")


def test_no_committed_result_names_a_path_of_the_machine_that_made_it():
    files = subprocess.run(["git", "ls-files", "-z", "results", "crr/tasks/sets"], cwd=ROOT, capture_output=True,
                           check=True).stdout
    paths = [ROOT / p for p in files.decode().split("\0") if p]
    assert paths, "no committed results found"
    found = []
    for path in paths:
        data = path.read_bytes()
        if (m := MACHINE_PATH.search(data)) or (m := re.search(re.escape(str(ROOT).encode()), data)):
            found.append(f"{path.relative_to(ROOT)}: {m.group().decode(errors='replace')}...")
    assert found == [], ("absolute paths in committed results (make them relative to the repository):\n"
                         + "\n".join(found))


def test_the_check_sees_the_paths_it_is_for():
    for bad in (b"--run /work/main/results/x", b'"model": "/root/.cache/crr/models/tiny-1"', b"/home/ana/crr/runs",
                b"at /tmp/pytest-of-x/run"):
        assert MACHINE_PATH.search(bad), bad
    for fine in (b"--run results/reference/x", b"~/.cache/crr/models/tiny-1", b"/testbed/pkg/core.py", b"a/work/b"):
        assert not MACHINE_PATH.search(fine), fine


CPU_MAIN = ROOT / "results" / "reference" / "cpu-main"
# README's paired figures of the CPU study, greedy on nano-test2 (points: difference, 95 % CI over tasks, over tasks
# and seeds, resolvable at 80 % power)
README_CRR_GRPO = [-1.4, -2.7, -0.1, -4.0, 1.0, 2.7]
README_GRPO_START = [3.0, 0.7, 5.5, -0.0, 6.1, 3.9]


def _rewards_by_task(results: Path) -> dict[str, list[float]]:
    """An eval run's results.jsonl as each task's rewards, one per sample."""
    solved: dict[str, list[float]] = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        solved.setdefault(r["instance_id"], []).append(r["reward"])
    return solved


def _final_task_rates(arm: str, samples: int) -> list[dict[str, float]]:
    """Per-task success rates of each seed's final model of `arm` in the committed study, from results.jsonl."""
    out = []
    for config in sorted((CPU_MAIN / "evals" / arm).glob("*/config.yaml")):
        cfg = yaml.safe_load(config.read_text())
        if cfg["checkpoint"] is None and cfg["samples"] == samples:
            solved = _rewards_by_task(config.parent / "results.jsonl")
            out.append({iid: float(np.mean(v)) for iid, v in solved.items()})
    return out


def test_the_committed_report_recomputes_from_its_per_task_records():
    """The CPU study's report (intervals, pass^k, the paired comparisons, against each other and against the
    starting policy, and their power line) from the committed per-task records alone, with crr.eval.stats: what
    README's CPU-scale section quotes. Greedy on the 256 nano-test2 tasks, 4 samples on the first 128."""
    main = pd.read_csv(CPU_MAIN / "report" / "main.csv").set_index("arm")
    paired = pd.read_csv(CPU_MAIN / "report" / "paired.csv")
    passk = pd.read_csv(CPU_MAIN / "report" / "passk.csv")
    base = {yaml.safe_load(c.read_text())["samples"]: _rewards_by_task(c.parent / "results.jsonl")
            for c in (CPU_MAIN / "evals" / "base").glob("*/config.yaml")}
    assert sorted(base) == [1, 4] and len(base[1]) == 256 and len(base[4]) == 128
    for label, arm in (("GRPO", "grpo"), ("CRR", "crr")):
        seeds = _final_task_rates(arm, 1)
        assert len(seeds) == 3 and all(len(s) == 256 for s in seeds)
        rate = np.mean([np.mean(list(s.values())) for s in seeds])
        assert main.at[label, "pass_at_1"] == pytest.approx(100 * rate)
        assert (main.at[label, "ci_low"], main.at[label, "ci_high"]) == pytest.approx(
            tuple(100 * x for x in wilson(rate, 256)))
        sampled = _final_task_rates(arm, 4)
        assert len(sampled) == 3 and all(len(s) == 128 for s in sampled)
        hat = np.mean([np.mean([pass_hat_k(4, round(4 * v), 2) for v in s.values()]) for s in sampled])
        assert passk[passk.arm == label].pass_hat_2.mean() == pytest.approx(100 * hat)
    for samples in (1, 4):
        crr, grpo = _final_task_rates("crr", samples), _final_task_rates("grpo", samples)
        tasks = sorted(crr[0])
        start = [float(np.mean(base[samples][t])) for t in tasks]
        for a, b, c in (("CRR", "GRPO", compare([[s[t] for t in tasks] for s in crr],
                                                [[s[t] for t in tasks] for s in grpo])),
                        ("GRPO", "base policy (default)",
                         compare([[s[t] for t in tasks] for s in grpo], [start], fixed_b=True))):
            row = paired[(paired.a == a) & (paired.b == b) & (paired.samples == samples)].iloc[0]
            got = (row["diff"], row.ci_tasks_low, row.ci_tasks_high, row.ci_tasks_seeds_low, row.ci_tasks_seeds_high,
                   row.mde)
            assert got == pytest.approx(tuple(100 * x for x in (c.diff, *c.ci_tasks, *c.ci_tasks_seeds, c.mde)))
            assert (row.a_ahead, row.b_ahead) == (c.a_ahead, c.b_ahead)
    # the figures README quotes, greedy: CRR - GRPO, and GRPO - the starting policy
    quoted = {("CRR", "GRPO"): README_CRR_GRPO, ("GRPO", "base policy (default)"): README_GRPO_START}
    for (a, b), figures in quoted.items():
        row = paired[(paired.a == a) & (paired.b == b) & (paired.samples == 1)].iloc[0]
        assert [round(x, 1) for x in (row["diff"], row.ci_tasks_low, row.ci_tasks_high, row.ci_tasks_seeds_low,
                                      row.ci_tasks_seeds_high, row.mde)] == figures, (a, b)


def test_the_starting_policys_figures_have_their_per_task_records():
    """README's greedy figures of the shipped default, from their records: 37.5 % (24/64) on the first 64
    nano-test tasks, 58.8 % (47/80) on nano-band."""
    (run,) = (ROOT / "results" / "reference" / "default-greedy").glob("*/results.jsonl")
    records = [json.loads(line) for line in run.read_text().splitlines()]
    assert len({r["instance_id"] for r in records}) == 64 and sum(r["reward"] for r in records) == 24
    summary = json.loads((run.parent / "summary.json").read_text())
    assert summary["pass_at_1_ci"] == pytest.approx(list(wilson(24 / 64, 64)))
    assert yaml.safe_load((run.parent / "config.yaml").read_text())["model"] == "crr/policy/default"
    # and its 47 of the 80 nano-band tasks (58.8 %), the "before" of README's training-task figures
    (band,) = (ROOT / "results" / "reference" / "default-band").glob("*/results.jsonl")
    records = [json.loads(line) for line in band.read_text().splitlines()]
    assert len({r["instance_id"] for r in records}) == 80 and sum(r["reward"] for r in records) == 47


def test_the_starting_policys_fresh_test_figures_have_their_per_task_records():
    """README's figures of the shipped default on nano-test2 (test tasks 64-319, never used to choose anything):
    greedy 83/256 with its Wilson interval (the first 64 of them, make main's "before", 12/64) and sampled."""
    runs = {yaml.safe_load((c.parent / "config.yaml").read_text())["samples"]: c.parent
            for c in (ROOT / "results" / "reference" / "default-test2").glob("*/config.yaml")}
    records = [json.loads(line) for line in (runs[1] / "results.jsonl").read_text().splitlines()]
    index = {int(r["instance_id"].rsplit("-", 1)[1]): r["reward"] for r in records}
    assert sorted(index) == list(range(64, 320)) and sum(index.values()) == 83
    assert sum(index[i] for i in range(64, 128)) == 12
    summary = json.loads((runs[1] / "summary.json").read_text())
    assert summary["dataset"] == "nano-test2" and summary["model"] == "crr/policy/default"
    assert summary["pass_at_1_ci"] == pytest.approx(list(wilson(83 / 256, 256)))
    # sampled (4 per task, T = 0.6): 279 of 1,024 samples, 105 tasks solved at least once, 38 by all four
    solved = _rewards_by_task(runs[4] / "results.jsonl")
    assert len(solved) == 256 and all(len(v) == 4 for v in solved.values())
    assert sum(map(sum, solved.values())) == 279
    assert sum(any(v) for v in solved.values()) == 105 and sum(all(v) for v in solved.values()) == 38
    assert json.loads((runs[4] / "summary.json").read_text())["pass_at_k"]["4"] == pytest.approx(105 / 256)


def test_the_multi_warm_starts_figures_have_their_per_task_records():
    """README's figures of the shipped multi warm start (crr/policy/multi), from their records: chosen on 13/64 of
    the first 64 multi-val tasks, 18/64 on the first 64 multi-test tasks, each with its Wilson interval; the
    shipped provenance quotes the same evaluations."""
    reference = ROOT / "results" / "reference" / "multi-warm-2h"
    provenance = json.loads((ROOT / "crr" / "policy" / "multi" / "provenance.json").read_text())
    quoted = {(e["dataset"], e["samples"]): e["pass_at_1"] for e in provenance["evaluations"]}
    for name, dataset, solved in (("v3-multi-val-64", "multi-val", 13), ("v3-multi-test-64", "multi-test", 18)):
        (run,) = (reference / name).glob("results.jsonl")
        records = [json.loads(line) for line in run.read_text().splitlines()]
        assert len({r["instance_id"] for r in records}) == 64 and sum(r["reward"] for r in records) == solved
        summary = json.loads((run.parent / "summary.json").read_text())
        assert summary["pass_at_1_ci"] == pytest.approx(list(wilson(solved / 64, 64)))
        assert quoted[(dataset, 1)] == pytest.approx(solved / 64)
    assert provenance["recipe"]["file"] == "experiments/sft-multi-2h.yaml"
