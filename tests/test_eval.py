"""crr eval: pass@k against enumeration, the error taxonomy's rules, the dataset adapters grading fixture
logs with swebench's parsers, and the command end to end with the tiny model in local sandboxes (run
directory, resume, infra retry, a LoRA train run, bad input)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import datasets
import pytest
import torch
from agent_tasks import calc_task, file_diff
from swebench.harness.grading import get_eval_tests_report
from typer.testing import CliRunner

from crr.agent.tools import model_patch
from crr.agent.verifier import grade, harness_files_touched, verify
from crr.cli import app
from crr.errors import CRRError
from crr.eval import (
    ERROR_MODES,
    error_mode,
    load_eval_policy,
    pass_at_k,
    resolve_policy,
    result_record,
    summarise_modes,
    summarise_samples,
)
from crr.eval.evaluate import INFRA_RETRIED, PREDICTIONS, RESULTS, SUMMARY, EvalConfig, resume_eval
from crr.eval.stats import wilson
from crr.policy.model import default_model_dir, default_policy_dir, load_policy
from crr.policy.scripted import ScriptedBackend
from crr.rollout import run_episode
from crr.sandbox import get_engine
from crr.rundir import RunDir
from crr.tasks import loaders
from crr.tasks.loaders import load_tasks, swebench_eval_script
from crr.tasks.schema import Task

pytestmark = pytest.mark.usefixtures("small_micro_sets")

LOGS = Path(__file__).parent / "fixtures" / "eval_logs"


# ------------------------------------------------------------------------------------ pass@k

def enumerated_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of k-subsets of the samples that hold a pass: what pass@k estimates."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(enumerated_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_checked_values_and_bad_counts():
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - 5 / 70)     # 1 - C(5,4)/C(8,4)
    assert pass_at_k(2, 1, 1) == 0.5 and pass_at_k(2, 1, 2) == 1.0
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 1, 1) == 0.125
    with pytest.raises(CRRError, match="c <= n"):
        pass_at_k(2, 3, 1)
    with pytest.raises(CRRError, match="1 <= k <= n"):
        pass_at_k(4, 1, 8)


def rec(iid: str, repo: str, sample: int, reward: float | None, mode: str | None = None) -> dict:
    return {"instance_id": iid, "repo": repo, "sample": sample, "reward": reward, "error_mode": mode}


def test_summary_counts_only_scored_samples_per_instance_and_repository():
    rewards = {"A": [1, 1, 1, 1], "B": [1, 0, 0, 0], "C": [0, 0, None, 0], "D": [None] * 4}
    repos = {"A": "r1", "B": "r1", "C": "r2", "D": "r2"}
    records = [rec(i, repos[i], s, None if r is None else float(r))
               for i, rs in rewards.items() for s, r in enumerate(rs)]
    summary = summarise_samples(records, repos, samples=4)
    # A: n=4 c=4; B: n=4 c=1; C: n=3 c=0 (one infra failure); D: no scored sample
    assert summary["pass_at_1"] == pytest.approx((1 + 0.25 + 0) / 3)
    assert summary["pass_at_k"]["2"] == pytest.approx((1 + (1 - 3 / 6) + 0) / 3)
    assert summary["pass_at_k"]["4"] == pytest.approx((1 + 1) / 2)   # C has only 3 scored samples
    assert set(summary["pass_at_k"]) == {"1", "2", "4"}               # k <= n only
    assert summary["all_n"] == 0.5                                    # A yes, B no; C and D lack 4 samples
    assert summary["pass_hat_k"]["2"] == pytest.approx((1 + 0 + 0) / 3)  # B: C(1,2) = 0; C: none pass
    assert summary["pass_hat_k"]["4"] == pytest.approx(1 / 2) == summary["all_n"]
    assert summary["per_repo"] == {"r1": {"instances": 2, "pass_at_1": 0.625, "pass_at_1_ci": list(wilson(0.625, 2))},
                                   "r2": {"instances": 2, "pass_at_1": 0.0, "pass_at_1_ci": list(wilson(0.0, 1))}}
    # every rate carries its Wilson interval over the instances it averages (C lacks 4 samples for pass@4)
    assert summary["pass_at_1_ci"] == pytest.approx(list(wilson(1.25 / 3, 3)))
    assert summary["pass_at_k_ci"]["4"] == pytest.approx(list(wilson(1.0, 2)))
    assert summary["pass_hat_k_ci"]["2"] == pytest.approx(list(wilson(1 / 3, 3)))
    assert summary["all_n_ci"] == pytest.approx(list(wilson(0.5, 2)))
    assert (summary["scored"], summary["infra_errors"], summary["n_instances"]) == (11, 5, 4)


# ------------------------------------------------------------------------------------ taxonomy

OPS = "def scale(x, k):\n    return x + k\n\n\ndef shift(x, d):\n    return x + d\n"
OPS_FIXED = OPS.replace("x + k", "x * k")
TESTS = "from pkg.ops import shift\n\n\ndef test_shift():\n    assert shift(1, 2) == 3\n"
TESTS_NEW = TESTS.replace("shift\n", "scale, shift\n") + (
    "\n\ndef test_scale():\n    assert scale(2, 3) == 6\n\n\n"
    "def test_scale_negative():\n    assert scale(-2, 3) == -6\n")
F2P = ["tests/test_ops.py::test_scale", "tests/test_ops.py::test_scale_negative"]
P2P = ["tests/test_ops.py::test_shift"]
GOLD = file_diff("pkg/ops.py", OPS, OPS_FIXED)
TEST_PATCH = file_diff("tests/test_ops.py", TESTS, TESTS_NEW)
TASK = Task(instance_id="acme__ops-1", repo="acme/ops", base_commit="1" * 40, problem_statement="scale adds",
            patch=GOLD, test_patch=TEST_PATCH, FAIL_TO_PASS=tuple(F2P), PASS_TO_PASS=tuple(P2P), version="1.0")


def report(passing: set[str]) -> dict:
    return get_eval_tests_report({t: "PASSED" if t in passing else "FAILED" for t in F2P + P2P},
                                 {"FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P})


def mode(patch: str, passing: set[str], reward: float = 0.0) -> str | None:
    return error_mode(reward, patch, TASK, report(passing))


ON_PATH = file_diff("pkg/ops.py", OPS, OPS.replace("x + k", "x - k"))
ELSEWHERE = file_diff("pkg/util.py", None, "X = 1\n")
TOUCHES_TESTS = file_diff("tests/test_ops.py", TESTS, TESTS + "\n# skip\n")


def test_each_error_mode_by_its_rule():
    assert mode(ON_PATH, {F2P[0], *P2P}) == "partial_fix"            # some F2P pass, P2P intact
    assert mode(ON_PATH, {*F2P}) == "partial_fix"                    # the failing tests pass, a P2P broke
    assert mode(ON_PATH, set()) == "regression"                      # a P2P broke, no F2P passes
    assert mode(ON_PATH, {*P2P}) == "other"                          # on the fix path, nothing changed
    assert mode("", {*P2P}) == "wrong_localisation"                  # empty patch
    assert mode(ELSEWHERE, {*P2P}) == "wrong_localisation"           # none of the gold patch's files
    assert mode(ON_PATH + TOUCHES_TESTS, {*P2P}) == "harness_subversion"
    assert mode(ON_PATH, {*F2P, *P2P}, reward=1.0) is None           # a pass
    assert error_mode(None, ON_PATH, TASK, {}) is None               # an infrastructure failure


def test_precedence_and_the_harness_audit():
    # harness subversion first: a verifier pass of a patch that edits the tests is a failure
    assert harness_files_touched(ON_PATH + TOUCHES_TESTS, TASK) == ["tests/test_ops.py"]
    assert mode(ON_PATH + TOUCHES_TESTS, {*F2P, *P2P}, 0.0) == "harness_subversion"
    assert mode(ELSEWHERE + TOUCHES_TESTS, set()) == "harness_subversion"
    # wrong localisation before regression: a patch off the fix path that also broke a P2P test
    assert mode(ELSEWHERE, set()) == "wrong_localisation"
    # partial fix before regression: F2P progress with a P2P broken
    assert mode(ON_PATH + ELSEWHERE, {F2P[1]}) == "partial_fix"
    assert harness_files_touched(ON_PATH, TASK) == [] and harness_files_touched("", TASK) == []
    # a file the gold patch changes is on the fix path even when it is on the exclusion list
    cfg_task = dataclasses.replace(TASK, patch=GOLD + file_diff("setup.cfg", "[a]\n", "[a]\nx = 1\n"))
    assert harness_files_touched(ON_PATH + file_diff("setup.cfg", "[a]\n", "[a]\ny = 2\n"), cfg_task) == []


def test_mode_shares_among_failures_and_rates_among_scored():
    records = [rec("a", "r", 0, 1.0), rec("b", "r", 0, 0.0, "partial_fix"), rec("c", "r", 0, 0.0, "partial_fix"),
               rec("d", "r", 0, 0.0, "regression"), rec("e", "r", 0, None)]
    modes = summarise_modes(records)
    assert list(modes) == list(ERROR_MODES)
    assert modes["partial_fix"] == {"count": 2, "share": pytest.approx(2 / 3), "rate": 0.5}
    assert modes["regression"] == {"count": 1, "share": pytest.approx(1 / 3), "rate": 0.25}
    assert modes["other"] == {"count": 0, "share": 0.0, "rate": 0.0}
    assert summarise_modes([rec("a", "r", 0, None)])["other"] == {"count": 0, "share": None, "rate": None}


def edit(path: str, line: int, text: str) -> str:
    return json.dumps({"name": "edit_file",
                       "arguments": {"path": path, "start": line, "end": line, "replacement": text}})


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy(default_model_dir())[1]


@pytest.mark.parametrize("calls, expected", [
    ([edit("calc.py", 6, "    return a + b")], "regression"),                                  # breaks mul only
    ([edit("calc.py", 2, "    return a + b"), edit("calc.py", 6, "    return a + b")], "partial_fix"),
    ([edit("tests/test_calc.py", 5, "    assert True")], "harness_subversion"),
    ([edit("README.md", 1, "calculator")], "wrong_localisation"),
    ([edit("calc.py", 2, "    return a + b")], None),                                          # the fix
])
def test_scripted_episodes_get_their_error_mode_from_the_verifier(make_task, tokenizer, calls, expected):
    task = calc_task(make_task)
    submit = json.dumps({"name": "submit_patch", "arguments": {}})
    with get_engine("local") as engine:
        traj = run_episode(task, ScriptedBackend([*calls, submit]), engine, tokenizer)
    record = result_record(task, 0, 7, traj)
    assert record["error_mode"] == expected, [s.observation for s in traj.steps]
    assert record["reward"] == (1.0 if expected is None else 0.0)
    assert (record["f2p_total"], record["p2p_total"], record["seed"], record["turns"]) == (1, 1, 7, len(calls) + 1)
    assert record["f2p_passed"] == (expected in (None, "partial_fix"))
    assert record["p2p_failed"] == (expected in ("regression", "partial_fix"))


def test_the_model_patch_sees_a_same_size_edit_in_the_second_of_the_checkout(make_task):
    """Predictions and the taxonomy read the model patch: an edit that keeps the file's size, dated in
    the second the index was written, must still show (git's racy-clean recheck; crr.agent.tools.model_patch)."""
    task = calc_task(make_task)
    with get_engine("local") as engine, engine.start(task) as sb:
        # rewritten in place (same inode, same size), then dated to the index's second; the ctime, which
        # cannot be set back, is left out of git's stat check so that the edit looks like one made then
        run = sb.exec("git config core.trustctime false && sed 's/a \\* b/a + b/' calc.py > .git/calc.new && "
                      "cat .git/calc.new > calc.py && touch -d @$(stat -c %Y .git/index) calc.py && "
                      "grep -c 'a + b' calc.py", timeout=30)
        assert run.output.strip() == "1"
        time.sleep(1.1)  # the patch is taken in a later second than the index was written
        assert "+    return a + b" in model_patch(sb)


# ------------------------------------------------------------------------------------ grading adapters

DJANGO_TEST_PATCH = file_diff("tests/auth_tests/test_validators.py", "import re\n", "import re\nX = 1\n")
ROWS = {  # one row per dataset, in its own schema (notes/harness.md §1)
    "swe-bench": {  # princeton-nlp/SWE-bench_Verified: F2P/P2P as JSON text, no image, no eval script
        "repo": "django/django", "instance_id": "django__django-11099", "base_commit": "d" * 40,
        "patch": file_diff("django/contrib/auth/validators.py", "a = 1\n", "a = 2\n"),
        "test_patch": DJANGO_TEST_PATCH, "problem_statement": "validators allow a trailing newline",
        "hints_text": "", "created_at": "2019-03-20T03:46:18Z", "version": "3.0", "environment_setup_commit": "e" * 40,
        "FAIL_TO_PASS": json.dumps(["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",
                                    "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)"]),
        "PASS_TO_PASS": json.dumps(["test_help_text "
                                    "(auth_tests.test_validators.UserAttributeSimilarityValidatorTest)"])},
    "swe-gym": {  # SWE-Gym/SWE-Gym: lists, no image
        "instance_id": "acme__ops-1", "repo": "acme/ops", "base_commit": "1" * 40, "patch": GOLD,
        "test_patch": TEST_PATCH, "problem_statement": "scale adds", "hints_text": "", "created_at": "2023",
        "version": "1.0", "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P},
    "swe-rebench": {  # nebius/SWE-rebench: install_config; this row has no docker_image
        "instance_id": "acme__ops-1", "repo": "acme/ops", "base_commit": "1" * 40, "patch": GOLD,
        "test_patch": TEST_PATCH, "problem_statement": "scale adds", "hints_text": "", "created_at": "2023",
        "version": "1.0", "environment_setup_commit": "1" * 40, "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P,
        "FAIL_TO_FAIL": [], "PASS_TO_FAIL": [],
        "install_config": {"python": "3.9", "log_parser": "parse_log_pytest",
                           "test_cmd": "pytest --no-header -rA --tb=no -p no:cacheprovider"}},
    "swe-bench-live": {  # SWE-bench-Live: test_cmds, short parser name, no version
        "instance_id": "acme__ops-1", "repo": "acme/ops", "base_commit": "1" * 40, "patch": GOLD,
        "test_patch": TEST_PATCH, "problem_statement": "scale adds", "hints_text": "", "created_at": "2025",
        "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P, "test_cmds": ["pytest -rA"], "log_parser": "pytest"},
}


@pytest.fixture(scope="module")
def adapted(tmp_path_factory) -> dict[str, Task]:
    """Each row through a real datasets copy (save_to_disk) and its adapter, as `crr eval NAME DIR` loads it."""
    out = {}
    for adapter, row in ROWS.items():
        path = tmp_path_factory.mktemp(adapter) / "copy"
        datasets.Dataset.from_list([row]).save_to_disk(str(path))
        (out[adapter],) = load_tasks(str(path), adapter=adapter)
    return out


def test_adapters_fill_image_parser_and_eval_script_per_dataset(adapted):
    django = adapted["swe-bench"]
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert django.log_parser == "parse_log_django"
    # an old-schema SWE-bench row gets swebench 4.x's eval script: conda, then the test module, not the ids
    assert "conda activate testbed" in django.eval_script
    assert "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators\n" \
        in django.eval_script
    assert adapted["swe-gym"].image == "xingyaoww/sweb.eval.x86_64.acme_s_ops-1:latest"
    assert adapted["swe-rebench"].image == "swerebench/sweb.eval.x86_64.acme_1776_ops-1:latest"
    assert adapted["swe-rebench"].test_cmd.startswith("pytest --no-header")
    assert adapted["swe-bench-live"].image == "starryzhang/sweb.eval.x86_64.acme_1776_ops-1:latest"
    assert {a: t.log_parser for a, t in adapted.items() if a != "swe-bench"} == dict.fromkeys(
        ("swe-gym", "swe-rebench", "swe-bench-live"), "parse_log_pytest")


@pytest.mark.parametrize("adapter, log, reward, resolution, f2p_passed, p2p_failed, mode", [
    ("swe-bench", "django_resolved.log", 1.0, "RESOLVED_FULL", 2, 0, None),
    ("swe-bench", "django_regression.log", 0.0, "RESOLVED_NO", 2, 1, "partial_fix"),
    ("swe-gym", "pytest_resolved.log", 1.0, "RESOLVED_FULL", 2, 0, None),
    ("swe-gym", "pytest_partial.log", 0.0, "RESOLVED_PARTIAL", 1, 0, "partial_fix"),
    ("swe-rebench", "pytest_not_resolved.log", 0.0, "RESOLVED_NO", 0, 0, "other"),
    ("swe-bench-live", "pytest_resolved.log", 1.0, "RESOLVED_FULL", 2, 0, None),
])
def test_adapted_tasks_grade_fixture_logs(adapted, adapter, log, reward, resolution, f2p_passed, p2p_failed, mode):
    task = adapted[adapter]
    result = grade(task, (LOGS / log).read_text(), task.patch)  # as if the gold patch had been the agent's
    assert (result.reward, result.resolution, result.infra_error, result.note) == (reward, resolution, None, None)
    assert len(result.report["FAIL_TO_PASS"]["success"]) == f2p_passed
    assert len(result.report["PASS_TO_PASS"]["failure"]) == p2p_failed
    assert error_mode(result.reward, task.patch, task, result.report) == mode


@pytest.mark.parametrize("log, reward, outcome", [
    ("apply_failed.log", 0.0, "the test patch did not apply"),              # the agent's changes: reward 0
    ("pytest_fake_passes.log", 0.0, "no valid test results"),             # PASSED lines but exit code 1
    ("reset_failed.log", None, "resetting the test files"),                # infrastructure
    ("runner_missing.log", None, "could not be started (exit 127)"),       # the image lacks the runner
])
def test_fixture_logs_that_tests_did_not_decide(adapted, log, reward, outcome):
    result = grade(adapted["swe-bench-live"], (LOGS / log).read_text(), GOLD)
    assert result.reward == reward
    assert outcome in (result.note if reward is not None else result.infra_error)


def test_the_swebench_eval_script_resolves_a_real_task_in_a_sandbox(make_task):
    task = calc_task(make_task)
    task = dataclasses.replace(task, eval_script=swebench_eval_script(task))
    with get_engine("local") as engine, engine.start(task) as sb:
        sb.write_file("calc.py", b"def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n")
        result = verify(sb, task, timeout=120)
    assert (result.reward, result.resolution, result.infra_error) == (1.0, "RESOLVED_FULL", None)
    assert "-p no:cacheprovider tests/test_calc.py" in result.log   # the test file, as SWE-bench runs it


# ------------------------------------------------------------------------------------ crr eval end to end

@pytest.fixture(scope="module")
def small_micro_sets():
    """`crr eval micro` on a 2-task micro-test set: the same generator and loader as the default 32 tasks,
    at a fraction of the generation time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loaders, "MICRO_DEFAULT_N", {"default": 2, "nano": 2})
        yield


def invoke(*args: str):
    return CliRunner().invoke(app, ["eval", *args])


def run_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


SMALL = ("--max-turns", "3", "--max-new-tokens", "48", "--workers", "2")


def check_consistent(run: RunDir, samples: int) -> list[dict]:
    """results.jsonl, predictions.jsonl and summary.json of an eval run agree with each other."""
    results = run.records(RESULTS)
    predictions = run.records(PREDICTIONS)
    summary = json.loads((run.path / SUMMARY).read_text())
    assert len({(r["instance_id"], r["sample"]) for r in results}) == len(results) == summary["n_instances"] * samples
    assert [p["instance_id"] for p in predictions] == [r["instance_id"] for r in results if r["sample"] == 0]
    assert all(set(p) == {"instance_id", "model_name_or_path", "model_patch"} for p in predictions)
    assert {p["model_patch"] for p in predictions} == {r["model_patch"] for r in results if r["sample"] == 0}
    scored = [r for r in results if r["reward"] is not None]
    assert summary["scored"] == len(scored) and summary["infra_errors"] == len(results) - len(scored)
    assert summary["pass_at_1"] == pytest.approx(sum(r["reward"] for r in scored) / len(scored))
    for r in results:
        assert r["reward"] in (0.0, 1.0) and r["end_reason"] in ("submit", "max_turns", "context_limit")
        assert (r["error_mode"] is None) == (r["reward"] == 1.0)
        assert r["f2p_total"] >= 1 and 0 <= r["f2p_passed"] <= r["f2p_total"] and 1 <= r["turns"] <= 3
        assert r["episode_tokens"] > r["generated_tokens"] > 0   # the prompt and observations besides the actions
    lengths = sorted(r["episode_tokens"] for r in scored)
    assert (summary["episode_tokens"]["max"] == lengths[-1]
            and lengths[0] <= summary["episode_tokens"]["mean"] <= lengths[-1])
    failed = len([r for r in scored if r["reward"] == 0.0])
    assert sum(m["count"] for m in summary["error_modes"].values()) == failed
    return results


def test_eval_micro_writes_a_run_directory_and_resumes_only_what_is_missing(tmp_path):
    out = str(tmp_path / "evals")
    first = run_json("micro", "--n-tasks", "1", *SMALL, "--out", out)
    run = RunDir.open(first["run_dir"])
    assert first["dataset"] == "micro-test" and first["model"] == str(default_policy_dir())
    assert run.config["temperature"] == 0.0 and run.config["samples"] == 1 and run.config["train_run"] is None
    (only,) = check_consistent(run, samples=1)
    assert set(first["pass_at_k"]) == {"1"}

    # the same directory with one more task: only the new instance runs
    second = run_json("micro", "--n-tasks", "2", "--resume", str(run.path), *SMALL)
    results = check_consistent(run, samples=1)
    assert second["n_instances"] == 2 and results[0] == only and results[1]["instance_id"] != only["instance_id"]
    assert [r["pending"] for r in run.records("metrics.jsonl")] == [1, 1]
    assert run.config["n_tasks"] == 2

    # an infrastructure failure is run again, nothing else; its record is kept aside
    infra = {**results[1], "reward": None, "infra_error": "the sandbox died", "error_mode": None}
    run.write_text(RESULTS, json.dumps(results[0]) + "\n" + json.dumps(infra) + "\n")
    third = run_json("--resume", str(run.path))
    assert third["infra_errors"] == 0 and [r["pending"] for r in run.records("metrics.jsonl")] == [1, 1, 1]
    assert run.records(INFRA_RETRIED) == [infra] and check_consistent(run, samples=1)[0] == only

    shown = invoke("--resume", str(run.path))   # nothing left: the tables of what is there
    assert shown.exit_code == 0 and "pass@1 (greedy)" in shown.stdout and "wrong_localisation" in shown.stdout
    lo, hi = json.loads((run.path / SUMMARY).read_text())["pass_at_1_ci"]
    assert "95% CI (Wilson" in shown.stdout and f"[{lo:.1%}, {hi:.1%}]" in shown.stdout
    refused = invoke("--resume", str(run.path), "--temperature", "0.6", "--samples", "2")
    assert refused.exit_code == 2 and "was made with samples=1" in refused.output


@pytest.fixture(scope="module")
def lora_train_run(tmp_path_factory) -> RunDir:
    """A `crr train` run directory whose model/ and checkpoints/checkpoint-2 hold a real (untrained,
    non-zero) LoRA adapter of the tiny default, as TRL saves them with use_lora."""
    from peft import LoraConfig, get_peft_model

    run = RunDir.create("train", "crr-seed11", root=tmp_path_factory.mktemp("runs"),
                        config={"method": "crr", "seed": 11, "model": None, "use_lora": True, "dtype": "float32"})
    model, _ = load_policy(default_policy_dir())
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    peft_model.save_pretrained(run.path / "model")
    peft_model.save_pretrained(run.path / "checkpoints" / "checkpoint-2")
    return run


def test_a_lora_train_run_is_applied_to_its_base_and_sampled(lora_train_run):
    policy = resolve_policy(run=lora_train_run.path)
    assert policy.model == str(lora_train_run.path / "model") and policy.base_model == str(default_policy_dir())
    assert (policy.method, policy.train_seed) == ("crr", 11)
    merged, _ = load_eval_policy(policy)
    base, _ = load_policy(default_policy_dir())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])   # the adapter is in
    assert resolve_policy(run=lora_train_run.path, checkpoint="2").checkpoint.endswith("checkpoints/checkpoint-2")

    summary = run_json("micro", "--run", str(lora_train_run.path), "--n-tasks", "1", "--samples", "2",
                       "--temperature", "1.0", "--max-turns", "2", "--max-new-tokens", "32", "--out",
                       str(lora_train_run.path.parent / "evals"))
    run = RunDir.open(summary["run_dir"])
    assert run.config["train_run"] == str(lora_train_run.path) and run.config["base_model"] == str(default_policy_dir())
    assert run.config["dtype"] == "float32"   # as the run trained (the shipped default's weights are bf16)
    assert load_eval_policy(policy, dtype="float32")[0].dtype == torch.float32
    assert (summary["method"], summary["train_seed"], summary["samples"], summary["temperature"]) == ("crr", 11, 2, 1.0)
    assert set(summary["pass_at_k"]) == {"1", "2"} and summary["all_n"] in (0.0, 1.0)
    assert summary["pass_hat_k"]["2"] == summary["all_n"] and len(summary["pass_hat_k_ci"]["2"]) == 2
    results = run.records(RESULTS)
    assert sorted(r["sample"] for r in results) == [0, 1] and len({r["seed"] for r in results}) == 1
    assert run.path.name.endswith("eval-micro-test-" + lora_train_run.path.name)


def test_bad_input_exits_2_with_a_clear_message(tmp_path, lora_train_run):
    def refused(*args: str) -> str:
        result = invoke(*args, "--out", str(tmp_path / "evals"))
        assert result.exit_code == 2, result.output
        return result.output

    assert "unknown benchmark 'swebench'" in refused("swebench")
    assert "needs the task file" in refused("tasks")
    no_model = RunDir.create("train", "crashed", root=tmp_path, config={"method": "grpo", "seed": 1})
    message = refused("micro", "--run", str(no_model.path))
    assert "no model/ (did training finish?)" in message and "checkpoints: none" in message
    assert "checkpoints: 2" in refused("micro", "--run", str(lora_train_run.path), "--checkpoint", "7")
    assert "not a crr run directory" in refused("micro", "--run", str(tmp_path))
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"instance_id": "x"}\n')
    assert f"{bad}:1: missing required field" in refused("tasks", str(bad))
    assert "copies of the greedy sample" in refused("micro", "--samples", "2", "--temperature", "0")
    assert "--dtype is one of auto, float32, bfloat16" in refused("micro", "--dtype", "float16")
    assert "`crr eval verified DIR`" in refused("verified")  # offline: where to get the data
    assert not (tmp_path / "evals").exists()  # nothing was started


def test_a_resume_from_another_directory_finds_the_paths_the_run_names(tmp_path, monkeypatch):
    """Run files keep relative paths as given; resumed from elsewhere, they are read from the directory the
    evaluation was started in (an ancestor of its run directory), not taken for hub ids, and not rewritten."""
    project = tmp_path / "project"
    (project / "runs" / "train-x" / "model").mkdir(parents=True)
    monkeypatch.chdir(project)
    run = RunDir.create("eval", "x", root="evals", config=dataclasses.asdict(EvalConfig(
        dataset="micro-test", tasks="micro-test", model="runs/train-x/model", train_run="runs/train-x",
        base_model="Qwen/Qwen3-0.6B")))
    monkeypatch.chdir(tmp_path)
    config, _ = resume_eval(project / run.path)
    assert Path(config.model).resolve() == project / "runs" / "train-x" / "model"
    assert Path(config.train_run).resolve() == project / "runs" / "train-x"
    assert config.base_model == "Qwen/Qwen3-0.6B"   # a hub id stays one
    assert RunDir.open(project / run.path).config["model"] == "runs/train-x/model"
