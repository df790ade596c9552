"""`crr credit audit` on one nano task with the shipped default policy (real sandboxes, real forks, real
verifier runs): the table has a row per estimator, the oracle's intervals are well-formed, a rerun skips the
recorded trajectories, and `crr report` reads the run. The statistics on
hand-checkable inputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.credit.audit import RECORDS, audit_records, estimator_names, load_audit_config, parse_overrides
from crr.credit.stats import estimator_metrics, values
from crr.eval.stats import wilson, z
from crr.report.credit import write_audit
from crr.rundir import RunDir, release_locks
from crr.train.advantages import ESTIMATORS

Z95 = z(0.975)


TINY = ["n_tasks=1", "group_size=2", "continuations=2", "repeats=2", "max_turns=2", "k=1", "eta=0.0", "cf_samples=1",
        "mc_samples=1", "bootstrap=50",
        "dtype=float32"]   # the shipped default's bf16 weights in float32: a CPU without AVX512-BF16 emulates bf16


# override -> the one-line error (before: a traceback, silent acceptance, or refused or dropped only after the
# oracle had been played)
BAD_VALUES = {
    "temperature=nan": "temperature='nan': expected a number",   # YAML's nan is a string (.nan the float)
    "temperature=.nan": "temperature=nan: expected a finite number",
    "cf_temperature=.inf": "cf_temperature=inf: expected a finite number",
    "continuations=two": "continuations='two': expected an integer",
    "k=1.5": "k=1.5: expected an integer",
    "estimators=grpo": "estimators='grpo': expected a list whose items are each a string",
    "estimators=[bogus]": "unknown advantage estimator 'bogus'; choose one of grpo, ",
    "estimators=[grpo,bogus]": "unknown advantage estimator 'bogus'; choose one of grpo, ",
    "estimators=[no_such_module:fn]": "advantage estimator 'no_such_module:fn': cannot import no_such_module",
    "advantage_params={gigpo: {nope: 1}}": "advantage estimator 'gigpo' does not take advantage_params",
    "group_size=1": "group_size=1: must be >= 2",          # train's num_generations: a group needs two siblings
    "horizon=-1": "horizon=-1: must be >= 1",
    "bootstrap=0": "bootstrap=0: must be >= 1",
    "eta=-1": "eta=-1: must be >= 0",
    "seed=-1": "seed=-1: must be in [0, 4294967295]",
    "selector=bogus": "unknown selector 'bogus'; choose one of entropy_type, ",
    "proposal=bogus": "unknown proposal 'bogus'; choose one of tempered, ",
    "variants={v: {horizon: 0}}": "variant 'v': horizon=0: must be >= 1",
    "variants={v: {proposal: bogus}}": "variant 'v': unknown proposal 'bogus'",
}


def test_bad_values_are_one_line_before_anything_is_made(tmp_path, monkeypatch):
    """Every key of the audit's config is type- and range-checked as train checks its own (train's ranges),
    and every estimator is resolved as train resolves advantage_estimator, before a run directory exists."""
    def played(*args, **kwargs):
        raise AssertionError("the audit was started")

    monkeypatch.setattr("crr.credit.audit.audit", played)
    out = tmp_path / "runs"
    for value, message in BAD_VALUES.items():
        result = CliRunner().invoke(app, ["credit", "audit", value, "--out", str(out)])
        release_locks()
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (value, result.output)
        assert message in lines[0], (value, lines[0])
    assert not out.exists()
    # a bad agent format or engine is refused before the task set is loaded (a named set is generated on its first use)
    monkeypatch.setattr("crr.tasks.loaders.load_tasks", lambda *_: pytest.fail("tasks loaded before the settings"))
    for value, message in {"agent_format=nope": "unknown agent format 'nope'",
                           "engine=nope": "unknown fork engine"}.items():
        result = CliRunner().invoke(app, ["credit", "audit", "tasks=multi-val", value, "--out", str(out)])
        assert result.exit_code == 2 and message in result.output, (value, result.output)
    monkeypatch.undo()
    monkeypatch.setattr("crr.credit.audit.audit", played)
    sft = RunDir.create("sft", root=tmp_path / "sft")   # another command's run: refused before it is locked
    release_locks()
    before = {p: p.stat().st_mtime_ns for p in sft.path.iterdir()}
    result = CliRunner().invoke(app, ["credit", "audit", "--resume", str(sft.path)])
    release_locks()
    assert result.exit_code == 2 and result.output.strip() == (f"error: {sft.path} is a `crr sft` run, not a credit "
                                                               "audit; --resume takes a directory made by crr "
                                                               "credit audit")
    assert {p: p.stat().st_mtime_ns for p in sft.path.iterdir()} == before
    # what train takes is taken: eta has no upper bound (entropies in nats), a function named by its dotted path
    # is an estimator, scored with the registered ones
    cfg = load_audit_config(None, {"eta": 2, "estimators": ["grpo", "crr.train.advantages:mc_values"]})
    assert cfg.eta == 2 and "crr.train.advantages:mc_values" in estimator_names(cfg)


def test_values_and_metrics_by_hand():
    # every continuation of every state succeeds and so does the trajectory: V = 1 everywhere, A* = 0
    v = values([[1.0, 1.0, 1.0], [1.0, 1.0, None]], 1.0)
    assert [r["V"] for r in v] == [1.0, 1.0] and [r["A"] for r in v] == [0.0, 0.0] and v[1]["V_n"] == 2
    assert v[0]["V_lo"] == pytest.approx(3 / (3 + Z95 ** 2)) and v[0]["V_hi"] == 1.0   # Wilson at 3/3
    # the second action wins: V(s_0) = 0, V(s_1) = 1 (4/4), R = 1 -> A*(0) = 1 (interval above 0), A*(1) = 0
    v = values([[0.0] * 4, [1.0] * 4], 1.0)
    assert v[0]["A"] == 1.0 and 0 < v[0]["A_lo"] < 1 <= v[0]["A_hi"] + 1e-12 and v[1]["A"] == 0.0
    assert values([[None], [1.0]], 1.0)[0]["A"] is None           # no scored continuation: unknown, not 0
    lo, hi = wilson(0.5, 2)
    assert lo < 0.5 < hi
    # an exact estimator, one off by +0.5 (bias only), one noisy around A* (variance only)
    truth = pd.DataFrame({"traj": ["a", "a", "b", "b"], "t": [0, 1, 0, 1], "A": [1.0, 0.0, -1.0, 0.0],
                          "A_lo": [0.2, -0.5, -1.0, -0.5], "A_hi": [1.0, 0.5, -0.2, 0.5]})
    two = pd.concat([truth.assign(repeat=0), truth.assign(repeat=1)], ignore_index=True)
    exact = estimator_metrics(two.assign(a=two["A"]), two["A"], boot=20)
    assert exact["pearson"] == pytest.approx(1) and exact["mse"] == 0 and exact["sign_agreement"] == 1
    assert exact["n_significant"] == 2 and exact["differs_from_grpo"] == 0
    biased = estimator_metrics(two.assign(a=two["A"] + 0.5), two["A"], boot=20)
    assert biased["bias2"] == pytest.approx(0.25) and biased["variance"] == 0 and biased["differs_from_grpo"] == 1
    # against a GRPO that ranks step b/1 wrong: Pearson 1 minus GRPO's, paired over the same resampled trajectories
    grpo = pd.Series([1.0, 0.0, -1.0, 1.0] * 2)
    ahead = estimator_metrics(two.assign(a=two["A"]), grpo, boot=200)
    r_grpo = float(np.corrcoef(grpo, two["A"])[0, 1])
    assert ahead["pearson_vs_grpo"] == pytest.approx(1 - r_grpo) and ahead["pearson_vs_grpo_lo"] >= 0
    assert ahead["pearson_vs_grpo_lo"] <= 1 - r_grpo <= ahead["pearson_vs_grpo_hi"] <= 2
    assert exact["pearson_vs_grpo"] == 0 and exact["pearson_vs_grpo_lo"] == exact["pearson_vs_grpo_hi"] == 0
    noisy = estimator_metrics(two.assign(a=two["A"] + ([0.1] * 4 + [-0.1] * 4)), None, boot=20)
    assert noisy["bias2"] == pytest.approx(0) and noisy["variance"] == pytest.approx(0.01)
    assert noisy["mse"] == pytest.approx(noisy["bias2"] + noisy["variance"]) and math.isnan(noisy["differs_from_grpo"])


def test_audit_end_to_end_resume_and_report(tmp_path, monkeypatch):
    def run(*args: str) -> str:
        result = CliRunner().invoke(app, ["credit", "audit", *args])
        assert result.exit_code == 0, result.output + repr(result.exception)
        return result.output

    variants = "variants={fe: {selector: first_edit_of_failure, horizon: 1}, mv: {selector: mid_value, cf_samples: 2}}"
    out = run("--config", "experiments/credit-audit-nano.yaml", *TINY, variants, "--out", str(tmp_path),
              "--engine", "local")
    (path,) = tmp_path.glob("*-credit-audit-*")
    records = [json.loads(line) for line in (path / RECORDS).read_text().splitlines()]
    assert len(records) == 2 and "rollouts/s" in out
    metrics = map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
    assert [r["dtype"] for r in metrics if r.get("event") == "start"] == ["float32"]   # the policy as dtype= loads it
    names = estimator_names(load_audit_config("experiments/credit-audit-nano.yaml", parse_overrides([variants])))
    assert {"grpo", "crr", "zero_contrast", "crr[fe]", "zero_contrast[fe]", "crr[mv]"} <= set(names)
    for rec in records:
        assert rec["reward"] in (0.0, 1.0) and len(rec["truth"]) == rec["steps"] == len(rec["continuations"])
        for t, truth in enumerate(rec["truth"]):
            assert truth["V_n"] == 2 and 0 <= truth["V_lo"] <= truth["V"] <= truth["V_hi"] <= 1
            assert -1 <= truth["A_lo"] <= truth["A"] <= truth["A_hi"] <= 1
            nxt = rec["truth"][t + 1]["V"] if t + 1 < rec["steps"] else rec["reward"]
            assert truth["A"] == pytest.approx(nxt - truth["V"])   # A*(t) = V(s_t+1) - V(s_t), V(s_T) = R
        assert len(rec["draws"]) == 2   # R
        for d in rec["draws"]:
            assert set(d["selected"]) <= set(range(rec["steps"])) and len(d["selected"]) <= 1   # k = 1
            assert all(len(v) == 1 for v in d["continuations"].values())                        # K = 1
            # the variants' budgets: the first edit of a failed trajectory only; mid_value with K = 2
            assert set(d["variants"]) == {"fe", "mv"}
            assert len(d["variants"]["fe"]["selected"]) <= (rec["reward"] == 0.0)
            assert d["variants"]["fe"]["cost"]["env_steps"] <= 2 * len(d["variants"]["fe"]["selected"])   # h = 1
            assert set(d["variants"]["mv"]["selected"]) <= set(range(rec["steps"]))
            assert all(len(v) <= 2 for v in d["variants"]["mv"]["counterfactuals"].values())
        assert rec["oracle"]["env_steps"] >= 2 * rec["steps"]
    assert sum(d["cost"]["counterfactuals"]["env_steps"] for r in records for d in r["draws"]) > 0   # eta=0: forks
    table = pd.read_csv(path / "credit_audit.csv")
    assert list(table["estimator"])[0] == "grpo" and sorted(table["estimator"]) == sorted(names)   # GRPO first
    by = table.set_index("estimator")
    assert by.loc["zero_contrast[fe]", "extra_env_steps_per_traj"] == 0
    assert by.loc["crr[mv]", "budget"] == "mid_value (eta=0), k=1 picks x K=2 forks"
    for bad in ("variants={x: {selector: nope}}", "variants={x: {k: 2, omega: 1}}", "variants={'a b': {k: 2}}"):
        refused = CliRunner().invoke(app, ["credit", "audit", *TINY, bad, "--out", str(tmp_path / "bad")])
        assert refused.exit_code == 2 and refused.output.startswith("error: variant"), refused.output
    assert (path / "credit_audit.png").is_file() and (path / "credit_audit.md").is_file()
    assert json.loads((path / "summary.json").read_text())["rollouts_per_s"] > 0
    # the oracle's continuations that end alike ran the tests once (crr.agent.verdicts), counted per task
    tasks = [r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "task"]
    assert sum(t["oracle_verdicts_reused"] for t in tasks) > 0

    # an estimator registered after the audit is scored from its records (here: MC values' budget, V(s_t) as
    # the mean of the recorded continuations, through the same estimate() call)
    def late(rows):
        def v(r, t):
            return r.reward if t == len(r.spans) else sum(r.continuations[t]) / len(r.continuations[t])
        return [None if r.reward is None else [v(r, t + 1) - v(r, t) if t in r.continuations and
                                               (t + 1 == len(r.spans) or t + 1 in r.continuations) else 0.0
                                               for t in range(len(r.spans))] for r in rows]

    monkeypatch.setitem(ESTIMATORS, "late_mc", late)
    write_audit(RunDir.open(path))
    late_row = pd.read_csv(path / "credit_audit.csv").set_index("estimator").loc["late_mc"]
    assert late_row["extra_env_steps_per_traj"] > 0 and late_row["steps"] == sum(r["steps"] for r in records)

    # a rerun skips the recorded trajectories (nothing is left to do: no model is loaded, no record added)
    run("--resume", str(path))
    assert (path / RECORDS).read_text().splitlines() == [json.dumps(r, sort_keys=True) for r in records]

    # a variant added to a recorded audit draws what it drew when the audit played it, without the oracle
    out = run("--config", "experiments/credit-audit-nano.yaml", *TINY, variants.replace(", mv: {selector: mid_value, "
              "cf_samples: 2}", ""), "--out", str(tmp_path / "later"), "--engine", "local")
    (later,) = (tmp_path / "later").glob("*-credit-audit-*")
    oracle = (later / RECORDS).read_text()
    run("--resume", str(later), "variants={mv: {selector: mid_value, cf_samples: 2}}")
    assert (later / RECORDS).read_text() == oracle   # nothing played again is recorded again

    def draws(records):
        return [[{v: {**part, "cost": part["cost"]["env_steps"]} for v, part in d["variants"].items()}
                 for d in r["draws"]]
                for r in records]

    assert draws(audit_records(later)) == draws(records)
    assert pd.read_csv(later / "credit_audit.csv").set_index("estimator").loc["crr[mv]", "budget"] == \
        "mid_value (eta=0), k=1 picks x K=2 forks"
    run("--resume", str(later), "variants={mv: {selector: mid_value, cf_samples: 2}}")   # nothing left: no model
    clash = CliRunner().invoke(app, ["credit", "audit", "--resume", str(later), "variants={mv: {k: 3}}"])
    assert clash.exit_code == 2 and "already in the audit with other settings" in clash.output, clash.output
    tampered = [json.loads(line) for line in oracle.splitlines()]
    tampered[0]["spans"][0][1] += 1
    (later / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in tampered))
    stale = CliRunner().invoke(app, ["credit", "audit", "--resume", str(later), "variants={h1: {horizon: 1}}"])
    assert stale.exit_code == 2 and "no longer replays as recorded" in stale.output, stale.output
    assert "h1" not in RunDir.open(later).config["variants"]   # refused: the audit's config is as it was

    report = CliRunner().invoke(app, ["report", "tables", "--runs", str(path), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "report" / "credit_audit.csv").is_file()
    assert "credit_audit" in (tmp_path / "report" / "report.md").read_text()


def test_a_lora_policy_is_audited_merged_into_its_base(tmp_path):
    """A trained LoRA policy (crr train's model/: an adapter with its agent record) is audited as eval samples
    it, merged into its base (before: loaded as a model directory, which has no tokenizer or weights)."""
    import shutil

    import torch
    from peft import LoraConfig, get_peft_model

    from crr.policy.model import AGENT_FILE, default_policy_dir, load_policy

    model, _ = load_policy(default_policy_dir())
    torch.manual_seed(0)
    adapter = tmp_path / "model"
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False,
                                     task_type="CAUSAL_LM")).save_pretrained(adapter)
    shutil.copyfile(default_policy_dir() / AGENT_FILE, adapter / AGENT_FILE)
    result = CliRunner().invoke(app, ["credit", "audit", *TINY, "estimators=[grpo]", f"model={adapter}",
                                      "--out", str(tmp_path / "runs"), "--engine", "local"])
    release_locks()
    assert result.exit_code == 0, result.output + repr(result.exception)
    (path,) = (tmp_path / "runs").glob("*-credit-audit-*")
    assert len(audit_records(path)) == 2
