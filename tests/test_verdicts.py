"""The run's verdicts by final state (crr.agent.verdicts): real sandboxes, real test runs; the memo must give an
episode the verdict its own test run would have given, and never stand in where the calls do not fix the state."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from agent_tasks import calc_task

import crr.agent.verdicts as verdicts_module
from crr.agent.tools import ToolCall, execute
from crr.agent.verdicts import Verdicts, state_key
from crr.agent.verifier import verify

FIX = {"path": "calc.py", "start": 2, "end": 2, "replacement": "    return a + b"}
WRONG = {"path": "calc.py", "start": 2, "end": 2, "replacement": "    return a * b"}


def step(name: str, **arguments) -> SimpleNamespace:
    return SimpleNamespace(call={"name": name, "arguments": arguments})


@pytest.fixture
def test_runs(monkeypatch):
    """The verifier runs Verdicts makes (each a real one)."""
    runs = []

    def counted(*args, **kwargs):
        runs.append(args[1].instance_id)
        return verify(*args, **kwargs)
    monkeypatch.setattr(verdicts_module, "verify", counted)
    return runs


def test_the_key_is_the_task_and_the_calls_that_change_the_state(task, make_task):
    edits = [step("edit_file", **FIX), step("submit_patch")]
    same = [step("view_file", path="calc.py"), step("run_shell", command="grep -n add calc.py | head"),
            SimpleNamespace(call=None), step("edit_file", **FIX), step("submit_patch")]
    assert state_key(task, edits) == state_key(task, same) is not None
    assert state_key(task, edits) != state_key(task, [step("edit_file", **WRONG)])
    # run_tests runs the agent's code, which can write files: where it ran is part of the state
    tested = [step("run_tests", test_filter=""), step("edit_file", **FIX)]
    assert state_key(task, tested) not in (state_key(task, edits), state_key(task, tested[::-1]))
    # a shell command that can change anything: no key, always tested
    assert state_key(task, [step("run_shell", command="sed -i s/-/+/ calc.py")]) is None
    assert state_key(task, [step("run_shell", command="echo x > calc.py")]) is None
    other = calc_task(make_task, instance_id="calc-2")
    assert state_key(other, edits) != state_key(task, edits)
    assert state_key(task, edits, timeout=60) != state_key(task, edits)


def test_a_state_reached_again_gets_the_verdict_its_test_run_gives(engine, task, test_runs):
    verdicts, results = Verdicts(), []
    plays = [[step("edit_file", **FIX)], [step("view_file", path="calc.py"), step("edit_file", **FIX)],
             [step("edit_file", **WRONG)], [step("run_shell", command="sed -i s/a\\ -\\ b/a\\ +\\ b/ calc.py")]]
    for steps in plays:
        with engine.start(task) as sb:
            for s in steps:
                obs = execute(sb, ToolCall(s.call["name"], s.call["arguments"]))
                assert not obs.is_error, obs.text
            fresh = verify(sb, task, timeout=120)   # what the episode's own test run says
        with engine.start(task) as sb:
            for s in steps:
                execute(sb, ToolCall(s.call["name"], s.call["arguments"]))
            results.append((verdicts.verify(sb, task, steps, timeout=120), fresh))
    assert [r.reward for r, _ in results] == [f.reward for _, f in results] == [1.0, 1.0, 0.0, 1.0]
    for r, f in results:
        assert (r.model_patch, r.resolution, r.statuses, r.report) == (f.model_patch, f.resolution, f.statuses,
                                                                       f.report)
    # the second play reached the first's state (a view between): one test run for both; the shell-made fix
    # has no key and was tested although it reached the same files
    assert len(test_runs) == 3 and verdicts.reused == 1


def test_episodes_ending_together_in_one_state_run_the_tests_once(engine, task, test_runs):
    verdicts, steps = Verdicts(), [step("edit_file", **FIX)]
    boxes = [engine.start(task) for _ in range(3)]
    try:
        for sb in boxes:
            execute(sb, ToolCall("edit_file", FIX))
        out = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, verdicts.verify(boxes[i], task, steps, 120)))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for sb in boxes:
            sb.close()
    assert [r.reward for r in out] == [1.0] * 3
    assert len(test_runs) == 1 and verdicts.reused == 2


def test_an_infrastructure_failure_is_not_kept(engine, task, test_runs):
    verdicts, steps = Verdicts(), [step("edit_file", **FIX)]
    sb = engine.start(task)
    execute(sb, ToolCall("edit_file", FIX))
    sb.close()   # the sandbox is gone: reward None, an infra error
    assert verdicts.verify(sb, task, steps, timeout=120).reward is None
    with engine.start(task) as sb:
        execute(sb, ToolCall("edit_file", FIX))
        assert verdicts.verify(sb, task, steps, timeout=120).reward == 1.0
    assert len(test_runs) == 2 and verdicts.reused == 0
