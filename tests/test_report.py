"""`crr experiment run` and `crr report` on real run directories: a tiny comparison (CRR over two seeds, GRPO,
and GRPO given the CRR run's measured wall clock; the real tiny model, real local sandboxes, forks and TRL
updates; real `crr eval` runs greedy, at a checkpoint and sampled) is run once per module; the tables are
checked against numbers recomputed from the run files, every output format is checked, missing runs are named
with their commands, an interrupted comparison resumes, and bad input is a clear error."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import ran_task
from typer.testing import CliRunner

from crr.cli import app
from crr.eval.stats import compare, wilson
from crr.experiments import EXPERIMENTS, load_comparison, read_preset
from crr.report.runs import load_runs
from crr.rundir import read_jsonl
from crr.tasks.loaders import write_tasks
from crr.train.records import read_records
from crr.train.trainer import budget_allows_next
from crr.train.tuples import read_tuples


# The CPU preset cut down so that an update takes seconds: one task, G = 2, two turns (a fork at t = 0); GRPO
# one update over two seeds, CRR two updates (whose wall clock, the equal-wall-clock arm's budget, then buys
# GRPO more than one). Evaluated on two tasks in two repositories: greedy; the equal-wall-clock run also at a
# checkpoint; CRR with 2 samples of one task. The shipped default's bf16 weights train and are evaluated in fp32
# (bf16 is emulated on AVX2-only CPUs).
TINY = {"base": str(EXPERIMENTS / "cpu-crr.yaml"), "n_tasks": 1, "tasks_per_iteration": 1, "num_generations": 2,
        "max_turns": 2, "max_new_tokens": 32, "eta": 0.0, "workers": 2, "max_steps": 2, "dtype": "float32"}
EVAL = {"tasks": "eval.jsonl", "max_turns": 2, "max_new_tokens": 32}
SPEC = {"name": "tiny", "seeds": [11, 23], "base": True,     # the starting model evaluated too
        "eval": [EVAL, {**EVAL, "checkpoint_fractions": [0.5], "arms": ["grpo-equal-wall-clock"]},
                 {**EVAL, "n_tasks": 1, "samples": 2, "temperature": 0.6, "arms": ["crr"]}],
        # GRPO first: the first run in a process pays one-time warm-up costs, which should not inflate the CRR
        # wall clock that the equal-wall-clock arm receives as its budget
        "arms": {"grpo": {"config": "tiny-grpo.yaml"}, "crr": {"config": "tiny-crr.yaml", "seeds": [11]},
                 "grpo-equal-wall-clock": {"config": "tiny-grpo-wallclock.yaml", "budget_from": "crr", "seeds": [11]}}}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def comparison(ran_tasks_file, tmp_path_factory) -> Path:
    """The tiny comparison's output folder (runs/, evals/, report/), made by `crr experiment run`."""
    root = tmp_path_factory.mktemp("comparison")
    # e1's held-out test passes already: any patch that leaves the tests alone resolves it (pass rates above 0);
    # e2 is the run-the-tests task, which the untrained model mostly fails (the error taxonomy has failures)
    solved = replace(ran_task(root, "e1", "local/a"), FAIL_TO_PASS=("tests/test_ok.py::test_ok",), PASS_TO_PASS=())
    write_tasks([solved, ran_task(root, "e2", "local/b")], root / "eval.jsonl")
    (root / "tiny-crr.yaml").write_text(yaml.safe_dump({**TINY, "tasks": str(ran_tasks_file)}))
    (root / "tiny-grpo.yaml").write_text(yaml.safe_dump({"base": "tiny-crr.yaml", "method": "grpo", "max_steps": 1}))
    (root / "tiny-grpo-wallclock.yaml").write_text(yaml.safe_dump({"base": "tiny-grpo.yaml", "max_steps": 50}))
    (root / "tiny.comparison.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    result = invoke("experiment", "run", str(root / "tiny.comparison.yaml"), "--out", str(root / "out"))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return root / "out"


def train_dirs(out: Path, arm: str) -> list[Path]:
    return sorted(p.parent for p in (out / "runs" / arm).glob("*/manifest.json"))


def eval_dirs(out: Path, base: bool = False) -> list[tuple[Path, dict, dict]]:
    """The evaluations of the arms' models (base: of the model they start from, evals/base)."""
    return [(p.parent, yaml.safe_load((p.parent / "config.yaml").read_text()),
             json.loads((p.parent / "summary.json").read_text()))
            for p in sorted((out / "evals").glob("*/*/manifest.json")) if (p.parent.parent.name == "base") == base]


def wall(run: Path) -> float:
    return sum(it["wall_s"] for it in json.loads((run / "ledger.json").read_text())["iterations"])


def test_comparison_trains_every_arm_evaluates_and_reports(comparison):
    assert [len(train_dirs(comparison, a)) for a in ("crr", "grpo", "grpo-equal-wall-clock")] == [1, 2, 1]
    for arm in ("crr", "grpo", "grpo-equal-wall-clock"):
        for run in train_dirs(comparison, arm):
            assert (run / "summary.json").is_file() and (run / "model").is_dir()
    crr11 = train_dirs(comparison, "crr")[0]
    matched = train_dirs(comparison, "grpo-equal-wall-clock")[0]
    assert yaml.safe_load((matched / "config.yaml").read_text())["budget_hours"] == pytest.approx(wall(crr11) / 3600)
    # GRPO ran until one more update at its mean update time would have passed CRR's wall clock, not past it
    times = [it["wall_s"] for it in json.loads((matched / "ledger.json").read_text())["iterations"]]
    assert not budget_allows_next(times, wall(crr11)) and budget_allows_next(times[:-1], wall(crr11))
    evals = eval_dirs(comparison)
    for _, config, summary in evals:
        assert summary["missing"] == 0 and config["dataset"] == "eval"
    finals = [c for _, c, _ in evals if c["checkpoint"] is None]
    assert sorted((Path(c["train_run"]).parent.name, c["samples"]) for c in finals) == sorted(
        [("crr", 1), ("crr", 2), ("grpo", 1), ("grpo", 1), ("grpo-equal-wall-clock", 1)])
    # CRR's two updates usually buy GRPO (no forks) more than one; the equal-wall-clock run is then also evaluated at
    # its saved update whose cumulative wall clock is nearest half of that budget, unless that is its final update
    # (how many updates the budget buys, and which is nearest the half, are matters of timing: on a loaded machine
    # GRPO's first update can take as long as CRR's two, or its second update longer than its first)
    updates, half = len(times), wall(crr11) / 2
    assert {p.name for p in (matched / "checkpoints").iterdir()} == {f"checkpoint-{s}" for s in range(1, updates + 1)}
    cumulative = [sum(times[:s]) for s in range(1, updates + 1)]
    nearest = min(range(1, updates + 1), key=lambda s: (abs(cumulative[s - 1] - half), s))
    checkpoints = [(Path(c["train_run"]).parent.name, int(c["checkpoint"].rsplit("-", 1)[1])) for _, c, _ in evals
                   if c["checkpoint"]]
    assert checkpoints == ([("grpo-equal-wall-clock", nearest)] if nearest < updates else [])
    assert sum(s["pass_at_1"] > 0 for _, _, s in evals) >= 1   # e1 is solved: pass rates are not all zero
    # base: true evaluated the model the arms start from once per kind of evaluation (greedy; 2 samples of one task)
    base = eval_dirs(comparison, base=True)
    assert sorted((c["samples"], c["n_tasks"]) for _, c, _ in base) == [(1, None), (2, 1)]
    assert all(c["train_run"] is None and c["model"] == finals[0]["base_model"] and s["missing"] == 0
               for _, c, s in base)
    assert (comparison / "report" / "report.md").is_file() and (comparison / "report" / "main.md").is_file()


def test_tables_agree_with_the_run_files(comparison):
    out = comparison / "report"
    evals = eval_dirs(comparison)
    final = {(Path(c["train_run"]).parent.name, c["train_seed"], c["samples"]): s
             for _, c, s in evals if c["checkpoint"] is None}

    main = pd.read_csv(out / "main.csv")
    grpo = main[(main.arm == "GRPO") & (main.dataset == "eval")].iloc[0]
    rates = pd.Series([100 * final[("grpo", seed, 1)]["pass_at_1"] for seed in (11, 23)])
    assert grpo.pass_at_1 == pytest.approx(rates.mean()) and grpo["std"] == pytest.approx(rates.std(ddof=1))
    assert grpo.seeds == 2
    crr = main[(main.arm == "CRR") & (main.dataset == "eval")].iloc[0]
    assert crr.pass_at_1 == pytest.approx(100 * final[("crr", 11, 1)]["pass_at_1"]) and math.isnan(crr["std"])
    lo, hi = wilson(rates.mean() / 100, 2)                 # over the 2 evaluation tasks
    assert (grpo.ci_low, grpo.ci_high) == pytest.approx((100 * lo, 100 * hi))
    cell = f"{rates.mean():.1f} ± {rates.std(ddof=1):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
    assert "| GRPO " in (out / "main.md").read_text() and cell in (out / "main.md").read_text()

    # the paired comparison, recomputed from the evaluations' per-task records
    per_task = {}
    for p, c, _ in evals:
        if c["checkpoint"] is None and c["samples"] == 1:
            recs = pd.DataFrame(read_jsonl(p / "results.jsonl")).set_index("instance_id")["reward"].sort_index()
            per_task.setdefault(Path(c["train_run"]).parent.name, []).append(recs)
    paired = pd.read_csv(out / "paired.csv")
    row = paired[(paired.a == "CRR") & (paired.b == "GRPO") & (paired.samples == 1)].iloc[0]
    crr_t, grpo_t = pd.concat(per_task["crr"], axis=1).mean(1), pd.concat(per_task["grpo"], axis=1).mean(1)
    assert (row["diff"] == pytest.approx(100 * (crr_t - grpo_t).mean())
            and (row.tasks, row.seeds_a, row.seeds_b) == (2, 1, 2))
    assert (row.a_ahead, row.b_ahead) == (((crr_t - grpo_t) > 0).sum(), ((crr_t - grpo_t) < 0).sum())
    again = compare([r.values for r in per_task["crr"]], [r.values for r in per_task["grpo"]])
    assert (row.ci_tasks_seeds_low, row.ci_tasks_seeds_high, row.mde) == pytest.approx(
        (100 * again.ci_tasks_seeds[0], 100 * again.ci_tasks_seeds[1], 100 * again.mde))
    assert "| CRR - GRPO (equal wall clock) " in (out / "paired.md").read_text()
    # each arm against the starting model, a fixed model: no seed variance on its side
    (base_dir, _, base_summary), = [b for b in eval_dirs(comparison, base=True) if b[1]["samples"] == 1]
    start = pd.DataFrame(read_jsonl(base_dir / "results.jsonl")).set_index("instance_id")["reward"].sort_index()
    row = paired[(paired.a == "GRPO") & paired.b.str.startswith("base policy") & (paired.samples == 1)].iloc[0]
    again = compare([r.values for r in per_task["grpo"]], [start.values], fixed_b=True)
    assert (row.fixed_b
            and row["diff"] == pytest.approx(100 * (grpo_t - start).mean()) == pytest.approx(100 * again.diff))
    assert (row.mde, row.var_seed_b) == pytest.approx((100 * again.mde, 0.0)) and pd.isna(row.seeds_for_target)
    base_row = main[main.arm.str.startswith("base policy")].iloc[0]
    assert base_row.pass_at_1 == pytest.approx(100 * base_summary["pass_at_1"])

    accounting = pd.read_csv(out / "accounting.csv")
    for arm, folder in (("CRR", "crr"), ("GRPO", "grpo")):
        ledgers = [json.loads((r / "ledger.json").read_text())["iterations"] for r in train_dirs(comparison, folder)]
        rows = accounting[accounting.arm == arm]
        for key in ("rollout_s", "update_s", "wall_s", "trajectories", "forks", "generated_tokens_all"):
            assert rows[key].mean() == pytest.approx(
                sum(sum(it[key] for it in ls) for ls in ledgers) / len(ledgers)), key
    assert ((accounting[accounting.arm == "GRPO"].forks == 0).all()
            and accounting[accounting.arm == "CRR"].forks.sum() > 0)
    assert (accounting.cf_tokens == accounting.generated_tokens_all - accounting.generated_tokens_on_policy).all()
    crr_rows = accounting[accounting.arm == "CRR"]
    per_fork = f"{crr_rows.cf_tokens.mean() / crr_rows.forks.mean():.0f}"   # a branch's own tokens, per fork
    assert any(line.startswith("| Generated tokens per fork ") and per_fork in line
               for line in (out / "accounting.md").read_text().splitlines())
    observed = (crr_rows.observed_tokens_all - crr_rows.observed_tokens_on_policy).mean() / crr_rows.forks.mean()
    assert observed > 0 and any(line.startswith("| Observed tokens per fork ") and f"{observed:.0f}" in line
                                for line in (out / "accounting.md").read_text().splitlines())

    wallclock = pd.read_csv(out / "wallclock.csv")
    matched = wallclock[wallclock.arm == "GRPO (equal wall clock)"]
    run = train_dirs(comparison, "grpo-equal-wall-clock")[0]
    its = json.loads((run / "ledger.json").read_text())["iterations"]
    cum = pd.Series([it["wall_s"] for it in its]).cumsum()
    crr11 = train_dirs(comparison, "crr")[0]
    assert matched.hours.tolist() == pytest.approx([f * wall(crr11) / 3600 for f in (0.25, 0.5, 0.75, 1.0)])
    for row in matched.itertuples():     # the saved checkpoint (every update here) closest to each time
        assert row.step == int((cum - row.hours * 3600).abs().idxmin()) + 1
        assert row.trajectories == sum(it["trajectories"] for it in its[:row.step])
    # only the checkpoints the spec evaluates (the equal-wall-clock run's half-way one) are owed a pass@1
    assert "eval of the update-" not in (out / "wallclock.md").read_text()

    snr = pd.read_csv(out / "snr.csv").set_index("arm")
    per_run = [pd.Series([r["advantage_snr"] for r in read_jsonl(p / "metrics.jsonl")
                          if r.get("event") == "iteration" and r.get("advantage_snr") is not None]).mean()
               for p in train_dirs(comparison, "crr")]
    assert snr.at["CRR", "advantage_snr"] == pytest.approx(pd.Series(per_run).mean(), nan_ok=True)

    passk = pd.read_csv(out / "passk.csv")
    row = passk[(passk.arm == "CRR") & (passk.seed == 11)].iloc[0]
    assert row.pass_at_2 == pytest.approx(100 * final[("crr", 11, 2)]["pass_at_k"]["2"])
    assert row.all_n == pytest.approx(100 * final[("crr", 11, 2)]["all_n"])
    assert row.pass_hat_2 == pytest.approx(100 * final[("crr", 11, 2)]["pass_hat_k"]["2"]) == row.all_n
    (_, _, start_sampled), = [b for b in eval_dirs(comparison, base=True) if b[1]["samples"] == 2]
    start_row = passk[passk.arm.str.startswith("base policy")].iloc[0]
    assert start_row.pass_at_2 == pytest.approx(100 * start_sampled["pass_at_k"]["2"]) and pd.isna(start_row.seed)
    assert (row.pass_at_2_ci_low, row.pass_at_2_ci_high) == pytest.approx(
        tuple(100 * x for x in final[("crr", 11, 2)]["pass_at_k_ci"]["2"]))

    per_repo = pd.read_csv(out / "per_repo.csv")
    results = {c["train_seed"]: pd.DataFrame(read_jsonl(p / "results.jsonl")) for p, c, _ in evals
               if c["checkpoint"] is None and c["samples"] == 1 and Path(c["train_run"]).parent.name == "grpo"}
    expect = pd.concat(r.groupby("repo")["reward"].mean() * 100 for r in results.values()).groupby(level=0).mean()
    got = per_repo[per_repo.arm == "GRPO"].groupby("repo")["pass_at_1"].mean()
    assert sorted(got.index) == ["local/a", "local/b"] and got.to_dict() == pytest.approx(expect.to_dict())

    errors = pd.read_csv(out / "errors.csv")
    failed = results[11][results[11].reward == 0]
    counts = errors[(errors.arm == "GRPO") & (errors.seed == 11)].set_index("mode")["count"]
    assert counts.to_dict() == {m: int((failed.error_mode == m).sum()) for m in counts.index} and counts.sum() > 0

    forks = pd.read_csv(out / "fork_composition.csv")
    tuples = pd.concat([read_tuples(r) for r in train_dirs(comparison, "crr")]).dropna(subset=["reward", "cf_reward"])
    assert forks.forks.sum() == len(tuples) > 0
    assert forks.frequency.sum() == pytest.approx(100)

    # step credit: every on-policy step's advantage against GRPO's, recomputed from the trajectory records
    credit = pd.read_csv(out / "step_credit.csv").set_index("arm")
    steps = [s for r in train_dirs(comparison, "crr") for rec in read_records(r) if rec["kind"] == "trajectory"
             for s in rec["steps"]]
    assert credit.at["CRR", "steps"] == len(steps) > 0
    assert credit.at["CRR", "differs"] == sum(abs(s["advantage"] - s["grpo_advantage"]) > 1e-9 for s in steps)
    assert credit.at["CRR", "selected"] == sum(s["selected"] for s in steps) > 0   # eta = 0: every run selects
    assert credit.at["CRR", "pairs_1-0"] + credit.at["CRR", "pairs_0-1"] + credit.at["CRR", "pairs_1-1"] + \
        credit.at["CRR", "pairs_0-0"] == len(tuples)
    assert credit.at["GRPO", "differs"] == 0 and credit.at["GRPO", "seeds"] == 2


def test_every_format_is_written(comparison):
    out = comparison / "report"
    entries = json.loads((out / "report.json").read_text())["entries"]
    index = {f"{e['kind']}/{e['name']}": e for e in entries}
    tables = [e for e in entries if e["kind"] == "table"]
    assert [e["name"] for e in tables] == [
        "main", "composition", "search_select", "accounting", "wallclock", "ablation_k", "ablation_selector",
        "ablation_horizon", "ablation_cf_temperature", "paired", "snr", "covariance", "passk", "errors",
        "errors_absolute", "per_repo", "fork_composition", "step_credit"]
    report = (out / "report.md").read_text()
    for e in tables:
        assert f"[{e['name']}.md]({e['name']}.md)" in report
        if e["status"] != "missing":
            tex = (out / f"{e['name']}.tex").read_text()
            assert all(rule in tex
                       for rule in ("\\toprule", "\\midrule", "\\bottomrule", f"\\label{{tab:{e['name']}}}"))
            assert "±" not in tex and not pd.read_csv(out / f"{e['name']}.csv").empty
    for name in ("main", "accounting", "wallclock", "paired", "passk", "errors", "per_repo", "fork_composition", "snr",
                 "step_credit"):
        assert index[f"table/{name}"]["status"] != "missing", name
    for name in ("sample_efficiency", "train_reward", "ablations", "snr", "per_repo"):
        assert index[f"figure/{name}"]["files"] == [f"{name}.png", f"{name}.pdf"], name
        assert f"[{name}.png]({name}.png)" in report
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"


def test_missing_runs_are_named_with_their_commands(comparison, tmp_path):
    # without --spec the report follows the shipped specs of the runs' scale
    result = invoke("report", "tables", "--runs", str(comparison), "--out", str(tmp_path / "cpu"))
    assert result.exit_code == 0, result.output
    main = (tmp_path / "cpu" / "main.md").read_text()
    # cpu-main wants GRPO and Search-Select for seeds 11, 23 and 47: the absent ones come with their commands
    assert "grpo, seed 47: train run" in main and "crr train --config experiments/cpu-grpo.yaml --seed 47" in main
    assert "crr train --config experiments/cpu-crr.yaml --seed 23" in main
    assert "crr train --config experiments/cpu-search-select.yaml --seed 47" in main
    assert "crr eval nano-test2 --run" in main               # the spec's own benchmark was not run here
    assert "base policy: nano-test2 eval" in main and "crr eval nano-test2 --n-tasks 256" in main
    k = (tmp_path / "cpu" / "ablation_k.md").read_text()
    assert "crr train --config experiments/cpu-crr.yaml --seed 11 k=1" in k
    # the comparison's own report (`crr experiment run`, or --spec) follows its spec alone: nothing is missing
    result = invoke("report", "tables", "--runs", str(comparison), "--out", str(tmp_path / "own"),
                    "--spec", str(comparison.parent / "tiny.comparison.yaml"))
    assert result.exit_code == 0 and "runs missing" not in result.output, result.output
    for out in (comparison / "report", tmp_path / "own"):
        assert ("search" not in (out / "main.md").read_text().lower()
                and "Runs still to make" not in (out / "report.md").read_text())
    assert (tmp_path / "own" / "main.csv").read_text() == (comparison / "report" / "main.csv").read_text()

    # Only the GRPO run: tables that need forks have no data; their files say so and name the commands.
    result = invoke("report", "tables", "--runs", str(comparison / "runs" / "grpo"), "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    forks = (tmp_path / "fork_composition.md").read_text()
    assert "No data yet" in forks and "crr train --config experiments/cpu-crr.yaml --seed 11" in forks
    assert not (tmp_path / "fork_composition.tex").exists()
    assert "runs missing" in result.output and "crr train --config experiments/cpu-crr.yaml --seed 23" in result.output


def test_missing_run_commands_name_runs_relative_to_the_working_directory(comparison, tmp_path, monkeypatch):
    # a report made where the runs live names them as a fresh clone would, not by this machine's paths
    monkeypatch.chdir(comparison)
    result = invoke("report", "tables", "--runs", "runs", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    main = (tmp_path / "main.md").read_text()
    assert "crr eval nano-test2 --run runs/" in main and str(comparison) not in main


def test_a_corrupt_run_file_is_named(comparison, tmp_path):
    """A run file damaged after it was written is one line naming it, for `crr report` and `crr view` alike:
    JSON, YAML, and a trajectory part cut short (gzip's EOFError, which click alone would print as "Aborted.")."""
    def one_line_naming(path: Path, *command: str) -> None:
        result = invoke(*command)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and f"{path} is corrupt" in lines[0], result.output

    run = shutil.copytree(train_dirs(comparison, "grpo")[0], tmp_path / "runs" / "grpo-run")
    report = ("report", "tables", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "r"))
    (run / "ledger.json").write_text("{torn")
    one_line_naming(run / "ledger.json", *report)
    shutil.copy2(train_dirs(comparison, "grpo")[0] / "ledger.json", run / "ledger.json")

    part = sorted((run / "trajectories").glob("part-*.jsonl.gz"))[0]
    part.write_bytes(part.read_bytes()[:100])
    one_line_naming(part, "view", str(run), "--out", str(tmp_path / "v.html"))
    part.unlink()

    (run / "config.yaml").write_text("a: [b\n")
    for command in (report, ("view", str(run), "--out", str(tmp_path / "v.html"))):
        one_line_naming(run / "config.yaml", *command)

    ev = shutil.copytree(eval_dirs(comparison)[0][0], tmp_path / "ev")
    (ev / "summary.json").write_text("{bad")
    one_line_naming(ev / "summary.json", "view", str(ev), "--out", str(tmp_path / "v.html"))


def test_interrupted_comparison_resumes_and_complete_runs_are_skipped(comparison):
    spec = comparison.parent / "tiny.comparison.yaml"
    before = sorted(p.parent for p in comparison.rglob("manifest.json"))
    # an interrupted sampled evaluation (its last record lost) and a GRPO run interrupted after its last
    # checkpoint, before the final model and summary were written
    sampled = next(p for p, c, _ in eval_dirs(comparison)
                   if c["samples"] == 2 and Path(c["train_run"]).parent.name == "crr")
    lines = (sampled / "results.jsonl").read_text().splitlines(keepends=True)
    (sampled / "results.jsonl").write_text("".join(lines[:-1]))
    (sampled / "summary.json").unlink()
    grpo = next(r for r in train_dirs(comparison, "grpo") if r.name.endswith("seed11"))
    (grpo / "summary.json").unlink()
    shutil.rmtree(grpo / "model")

    dry = invoke("experiment", "run", str(spec), "--out", str(comparison), "--dry-run")
    assert dry.exit_code == 0 and "grpo seed 11 [resume] crr train --resume" in dry.output
    assert "grpo seed 23 [done]" in dry.output and "crr seed 11 [done]" in dry.output
    assert "base eval [done]" in dry.output and "base eval x2 [done]" in dry.output   # the starting model's evals
    only = invoke("experiment", "run", str(spec), "--out", str(comparison), "--dry-run", "--seed", "23")
    assert only.exit_code == 0 and "grpo seed 23 [done]" in only.output and "seed 11" not in only.output
    wrong = invoke("experiment", "run", str(spec), "--out", str(comparison), "--dry-run", "--seed", "5")
    assert wrong.exit_code == 2 and "seed(s) [5] are not in tiny.comparison.yaml" in wrong.output
    one = invoke("experiment", "run", str(spec), "--out", str(comparison), "--dry-run", "--seed", "11", "--arm", "crr")
    assert one.exit_code == 0 and "crr seed 11 [done]" in one.output and "grpo" not in one.output.split("arm ARM")[0]
    bad = invoke("experiment", "run", str(spec), "--out", str(comparison), "--dry-run", "--arm", "ppo")
    assert bad.exit_code == 2 and "arm(s) ['ppo'] are not in tiny.comparison.yaml" in bad.output

    result = invoke("experiment", "run", str(spec), "--out", str(comparison), "--no-report")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "resuming" in result.output and f"resuming {sampled.name}" in result.output
    assert "crr seed 11: done" in result.output
    assert sorted(p.parent for p in comparison.rglob("manifest.json")) == before      # nothing started afresh
    assert (grpo / "summary.json").is_file() and (grpo / "model" / "adapter_model.safetensors").is_file()
    assert len(list(read_jsonl(sampled / "results.jsonl"))) == len(lines)
    assert all(e.complete for e in load_runs([comparison]).evals)


def test_bad_input_is_a_clear_error(tmp_path):
    for args, message in (((str(tmp_path / "nope"),), "does not exist"),
                          ((str(tmp_path),), "holds no crr run directories")):
        result = invoke("report", "tables", "--runs", *args, "--out", str(tmp_path / "r"))
        assert result.exit_code == 2 and message in result.output, result.output
    (tmp_path / "file.txt").write_text("x")
    result = invoke("report", "plots", "--runs", str(tmp_path / "file.txt"), "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "is a file" in result.output
    other = tmp_path / "sft-run"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"command": "sft"}))
    result = invoke("report", "tables", "--runs", str(other), "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "no `crr train` or `crr eval` runs" in result.output

    (tmp_path / "bad.comparison.yaml").write_text(yaml.safe_dump(
        {"arms": {"grpo": {"config": str(EXPERIMENTS / "cpu-grpo.yaml"), "budget_from": "crr"}}}))
    result = invoke("experiment", "run", str(tmp_path / "bad.comparison.yaml"))
    assert result.exit_code == 2 and "takes its budget from 'crr'" in result.output
    result = invoke("experiment", "run", str(tmp_path / "none.comparison.yaml"))
    assert result.exit_code == 2 and "no comparison spec" in result.output
    arms = {"grpo": {"config": str(EXPERIMENTS / "cpu-grpo.yaml")},
            "multi": {"config": str(EXPERIMENTS / "multi-crr.yaml")}}
    for base, message in (("yes", "base is true or false"), (True, "its arms start from different models")):
        (tmp_path / "base.comparison.yaml").write_text(yaml.safe_dump({"base": base, "arms": arms}))
        result = invoke("experiment", "run", str(tmp_path / "base.comparison.yaml"), "--dry-run")
        assert result.exit_code == 2 and message in result.output, result.output


def test_presets_and_comparison_specs():
    from crr.credit.audit import load_audit_config
    from crr.eval.taxonomy import ERROR_MODES
    from crr.report.tables import ERROR_MODES as LABELS
    from crr.sft.warm_start import SFTRecipe
    from crr.train.config import load_config

    assert tuple(LABELS) == ERROR_MODES
    grpo = read_preset(EXPERIMENTS / "cpu-grpo.yaml")
    assert (grpo["method"] == "grpo"
            and grpo["learning_rate"] == read_preset(EXPERIMENTS / "cpu-crr.yaml")["learning_rate"])
    for preset in sorted(EXPERIMENTS.glob("*.yaml")):
        if preset.name.startswith("sft-"):                  # SFT recipes (crr sft --recipe)
            assert SFTRecipe.from_yaml(preset).stages
        elif preset.name.startswith("credit-audit"):        # crr credit audit --config
            assert load_audit_config(preset).continuations >= 1
        elif not preset.name.endswith(".comparison.yaml"):  # paper presets train in bf16 on a GPU
            cfg = load_config(preset, {"bf16": False} if preset.name.startswith("paper-") else {})
            assert cfg.method == read_preset(preset)["method"]
    assert load_config(EXPERIMENTS / "paper-grpo-wallclock.yaml", {"bf16": False}).max_trajectories is None
    names: dict[tuple, str] = {}
    for spec in sorted(EXPERIMENTS.glob("[!.]*.comparison.yaml")):
        comparison = load_comparison(spec)
        assert comparison.evals and set(comparison.seeds) <= {11, 23, 47}
        # an arm may add seeds past the spec's (multi-main gives GRPO and CRR a fourth and a fifth, 59 and 71)
        assert all(set(a.seeds) <= {11, 23, 47, 59, 71} for a in comparison.arms.values())
        for arm in comparison.arms.values():   # one arm, one name, across every spec of a scale
            key = (spec.name.split("-")[0], arm.budget_from, *sorted(arm.settings.items(), key=str))
            assert names.setdefault(key, arm.name) == arm.name
    assert load_comparison(EXPERIMENTS / "paper-main.comparison.yaml").arms["crr"].seeds == (11, 23, 47)


def test_a_comparison_runs_seed_by_seed_with_the_matched_arm_after_its_source(tmp_path):
    from crr.comparison import schedule

    spec = load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")
    order = [(arm.name, seed) for arm, seed in schedule(spec)]
    assert [seed for _, seed in order] == [11] * 5 + [23] * 5 + [47] * 5
    assert order[:5] == [("grpo", 11), ("crr", 11), ("search-select", 11), ("grpo-equal-wall-clock", 11),
                         ("resets", 11)]
    multi = [arm.name for arm, seed in schedule(load_comparison(EXPERIMENTS / "multi-main.comparison.yaml"))][:3]
    assert multi == ["grpo", "crr", "grpo-equal-wall-clock"]   # the spec's order: the matched arm third
    first = tmp_path / "first.comparison.yaml"
    first.write_text(f"seeds: [11]\narms:\n  matched: {{config: {EXPERIMENTS}/cpu-grpo.yaml, budget_from: crr}}\n"
                     f"  crr: {{config: {EXPERIMENTS}/cpu-crr.yaml}}\n")
    assert [arm.name for arm, _ in schedule(load_comparison(first))] == ["crr", "matched"]   # after its source
    ablations = load_comparison(EXPERIMENTS / "cpu-ablations.comparison.yaml")
    assert {seed for _, seed in schedule(ablations)} == {11} and len(schedule(ablations)) == len(ablations.arms)


def test_preset_base_chains_and_loops(tmp_path):
    from crr.errors import CRRError

    (tmp_path / "a.yaml").write_text("base: b.yaml\nk: 1\n")
    (tmp_path / "b.yaml").write_text(f"base: {EXPERIMENTS / 'cpu-crr.yaml'}\nk: 2\nselector: random\n")
    merged = read_preset(tmp_path / "a.yaml")
    assert merged["k"] == 1 and merged["selector"] == "random" and merged["method"] == "crr"
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(CRRError, match="loops"):
        read_preset(tmp_path / "a.yaml")
    crr = EXPERIMENTS / "cpu-crr.yaml"
    for seeds, message in (("seeds: [a]\n", "seeds must be a list of integers, got ['a']"),
                           ("seeds: 11\n", "seeds must be a list of integers, got 11")):
        (tmp_path / "x.comparison.yaml").write_text(f"{seeds}arms:\n  a: {{config: {crr}}}\n")
        with pytest.raises(CRRError, match=re.escape(message)):
            load_comparison(tmp_path / "x.comparison.yaml")
