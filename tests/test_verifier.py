"""The verifier on real tasks: held-out tests in real sandboxes, graded by swebench's own code."""

from __future__ import annotations

import logging

import pytest

from agent_tasks import CALC, F2P, P2P, TESTS, calc_task, file_diff
from crr.agent.tools import ToolCall, execute
from crr.agent.verifier import eval_script_lines, harness_files_touched, patch_paths, verify
from crr.sandbox import get_engine

PASS_EVERYTHING_CONFTEST = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def run(sb, name: str, **arguments) -> str:
    obs = execute(sb, ToolCall(name, arguments))
    assert not obs.is_error, obs.text
    return obs.text


def test_gold_patch_resolves(engine, task):
    with engine.start(task) as sb:
        sb.write_file("gold.patch", task.patch.encode())
        applied = run(sb, "run_shell", command="git apply gold.patch && rm gold.patch")
        assert applied.endswith("[exit code: 0]")
        result = verify(sb, task, timeout=120)
    assert result.infra_error is None and result.note is None
    assert result.reward == 1.0 and result.resolution == "RESOLVED_FULL"
    assert result.statuses == {F2P[0]: "PASSED", P2P[0]: "PASSED"}
    assert result.report["FAIL_TO_PASS"]["success"] == list(F2P)
    assert "+    return a + b" in result.model_patch and "test_calc" not in result.model_patch
    assert ">>>>> Start Test Output" in result.log and "2 passed" in result.log


def test_no_patch_fails_the_fail_to_pass_test(engine, task):
    with engine.start(task) as sb:
        result = verify(sb, task, timeout=120)
    assert result.reward == 0.0 and result.resolution == "RESOLVED_NO" and result.infra_error is None
    assert result.statuses == {F2P[0]: "FAILED", P2P[0]: "PASSED"}
    assert result.model_patch == "" and result.note is None


def test_edits_to_the_held_out_tests_are_reset_and_flagged(engine, task):
    with engine.start(task) as sb:  # the agent "fixes" the test instead of the code
        run(sb, "edit_file", path="tests/test_calc.py", start=6, end=5,
            replacement="\n\ndef test_add():\n    assert True\n")
        result = verify(sb, task, timeout=120)
    assert result.reward == 0.0 and result.statuses[F2P[0]] == "FAILED"
    assert harness_files_touched(result.model_patch, task) == ["tests/test_calc.py"]


def test_a_harness_subverting_conftest_passes_the_tests_but_scores_zero(engine, task):
    with engine.start(task) as sb:
        run(sb, "edit_file", path="conftest.py", start=1, end=0, replacement=PASS_EVERYTHING_CONFTEST)
        result = verify(sb, task, timeout=120)
    # the tests alone are fooled; the verifier's audit is not (tests/test_reward_hacking.py: the other hacks)
    assert result.resolution == "RESOLVED_FULL" and result.reward == 0.0 and result.infra_error is None
    assert result.harness_files == harness_files_touched(result.model_patch, task) == ["conftest.py"]
    assert "changes the test harness (conftest.py)" in result.note


def test_harness_files_touched_exclusion_list(task):
    paths = ["src/calc.py", "tests/unit/helpers.py", "pkg/test_x.py", "pkg/x_test.py", "conftest.py",
             "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", ".github/workflows/ci.yml",
             "pkg/tests.py", "docs/testing.md", "src/contest.py", "tests/test_calc.py", "pytest.py",
             "pkg/sitecustomize.py", "usercustomize.py", "x.pth", "pkg/__pycache__/m.cpython-311.pyc",
             "json.py", "unittest/__init__.py", "pluggy.py", "pkg/json.py", "test.py"]
    patch = "".join(file_diff(p, None, "x\n") for p in paths)
    assert patch_paths(patch) == paths
    flagged = harness_files_touched(patch, task)
    legit = ("src/calc.py", "docs/testing.md", "src/contest.py", "pkg/json.py", "test.py")
    assert flagged == [p for p in paths if p not in legit]
    # a module of the repository's own under a standard-library name is the repository's business
    assert harness_files_touched(file_diff("calc.py", "x\n", "y\n").replace("calc", "json"), task) == []
    assert harness_files_touched(task.patch, task) == []
    assert harness_files_touched("", task) == []


def test_a_hanging_patch_is_reward_zero_not_infra(engine, task):
    with engine.start(task) as sb:
        run(sb, "edit_file", path="calc.py", start=2, end=2, replacement="    while True:\n        pass")
        result = verify(sb, task, timeout=8)
    assert result.reward == 0.0 and result.timed_out and result.infra_error is None
    assert "timed out" in result.note and result.statuses[F2P[0]] == "MISSING"


def test_a_test_patch_that_cannot_apply_is_reward_zero_not_infra(engine, make_task):
    # the test patch creates tests/new/test_more.py; the agent made tests/new a file
    test_patch = file_diff("tests/new/test_more.py", None, "def test_more():\n    assert True\n")
    task = calc_task(make_task, test_patch=test_patch, FAIL_TO_PASS=("tests/new/test_more.py::test_more",))
    with engine.start(task) as sb:
        run(sb, "edit_file", path="tests/new", start=1, end=0, replacement="not a directory")
        result = verify(sb, task, timeout=120)
    assert result.reward == 0.0 and result.infra_error is None and result.harness_files == ["tests/new"]
    assert result.note.endswith("(the test patch did not apply over the agent's changes)")


def test_a_closed_sandbox_is_an_infra_error_not_reward_zero(engine, task, caplog):
    """...and no warning: a sandbox closed under the verifier is its owner shutting down (a SIGTERM mid-filter
    closes the engine), not a failure to report."""
    sb = engine.start(task)
    sb.close()
    with caplog.at_level(logging.WARNING, logger="crr.agent.verifier"):
        result = verify(sb, task, timeout=120)
    assert result.reward is None and result.resolution is None
    assert "could not take the model patch" in result.infra_error
    assert caplog.records == []


def test_an_eval_script_that_never_reaches_the_tests_is_infra(engine, make_task, caplog):
    broken = "#!/bin/bash\nset -uxo pipefail\nsource /nonexistent/activate\nexit 1\n"
    task = calc_task(make_task, eval_script=broken)
    with engine.start(task) as sb, caplog.at_level(logging.WARNING, logger="crr.agent.verifier"):
        result = verify(sb, task, timeout=120)
    assert result.reward is None and result.infra_error == "the eval script stopped before the tests started"
    assert [r.getMessage() for r in caplog.records] == ["verifier infra error: " + result.infra_error]


def test_a_test_runner_the_image_lacks_is_infra_not_reward_zero(engine, make_task):
    task = calc_task(make_task, test_cmd="no-such-test-runner -rA")
    with engine.start(task) as sb:
        result = verify(sb, task, timeout=120)
    assert result.reward is None and "could not be started (exit 127)" in result.infra_error


def test_the_tasks_own_eval_script_is_used(engine, make_task):
    base = calc_task(make_task)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "echo crr-custom-eval-script",
                        *eval_script_lines(base)])
    task = calc_task(make_task, eval_script=script)
    with engine.start(task) as sb:
        sb.write_file("calc.py", CALC.replace("a - b", "a + b").encode())
        result = verify(sb, task, timeout=120)
    assert result.reward == 1.0 and "crr-custom-eval-script" in result.log
    assert "Test Exit Code: 0" in result.log  # swebench's exit-code record was added to the script


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["commit", "overlay"])
def test_verifier_in_a_docker_sandbox(make_task, mode):
    task = calc_task(make_task)
    engine = get_engine("docker", mode=mode)
    try:
        with engine.start(task) as sb:
            assert sb.read_file("tests/test_calc.py").decode() == TESTS
            before = verify(sb, task, timeout=300)
        with engine.start(task) as sb:
            run(sb, "edit_file", path="calc.py", start=2, end=2, replacement="    return a + b")
            after = verify(sb, task, timeout=300)
        with engine.start(task) as sb:  # a container that dies is an infra error, never reward 0
            engine.client.containers.get(sb.name).kill()
            dead = verify(sb, task, timeout=300)
    finally:
        engine.close()
    assert before.reward == 0.0 and before.statuses == {F2P[0]: "FAILED", P2P[0]: "PASSED"}
    assert after.reward == 1.0 and after.statuses == {F2P[0]: "PASSED", P2P[0]: "PASSED"}
    assert dead.reward is None and "is gone" in dead.infra_error
