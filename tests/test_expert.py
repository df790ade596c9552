"""The exploring SFT expert: real micro tasks, real sandboxes, the real verifier."""

from __future__ import annotations

import re

import pytest
from agent_tasks import calc_task

from crr.agent.expert import (ExpertConfig, call_json, explore_script, fix_edits, gold_files, parse_issue_call,
                              parse_sed, sed_command)
from crr.agent.tools import execute, parse_tool_call
from crr.agent.verifier import verify
from crr.sandbox import get_engine
from crr.tasks.micro import generate_micro

EXPLORE = ExpertConfig(p_list=1.0)  # always lists the files, so decoys are always in view


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    # seed 0: task 1 has a look-alike legacy copy of the buggy function, task 0 has none
    return generate_micro(tmp_path_factory.mktemp("micro"), n=2, seed=0, split="train")


@pytest.fixture(scope="module")
def engine():
    eng = get_engine("local")
    yield eng
    eng.close()


def play(engine, task, calls):
    """Execute the calls in a fresh sandbox; returns (observations, verifier result)."""
    with engine.start(task) as sandbox:
        observations = [execute(sandbox, c) for c in calls]
        return observations, verify(sandbox, task)


def test_expert_explores_and_solves_micro_tasks(tasks, engine):
    for task in tasks:
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=0, config=EXPLORE)
        calls = plan.calls
        observations, result = play(engine, task, calls)
        assert result.reward == 1.0, (task.instance_id, [call_json(c) for c in calls])
        assert not any(o.is_error for o in observations)
        assert calls[-1].name == "submit_patch" and observations[-1].terminal
        viewed = [c.arguments["path"] for c in calls if c.name == "view_file"]
        assert set(gold_files(task)) <= set(viewed)
        decoys = [p for p in viewed if p not in gold_files(task)]
        assert decoys, f"{task.instance_id}: the expert viewed only the file it fixes"
        assert any(c.name == "run_tests" for c in calls)
        # every call is what the grammar-constrained policy could emit: it round-trips through the parser
        assert all(parse_tool_call(call_json(c)) == c for c in calls)


def test_wrong_edits_are_really_wrong_and_then_corrected(tasks, engine):
    kinds = set()
    for task, seed in ((tasks[0], 0), (tasks[1], 0), (tasks[1], 1)):  # task 1, seed 0 errs in the look-alike
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=seed, config=ExpertConfig(error_rate=1.0))
        assert plan.wrong_edit in ("wrong_fix", "lookalike")
        kinds.add(plan.wrong_edit)
        edits = [i for i, c in enumerate(plan.calls) if c.name == "edit_file"]
        assert len(edits) > len(fix_edits(task))
        # The state right after the first (wrong) edit fails the held-out tests (verified in a fork of it);
        # the episode goes on to solve the task.
        with engine.start(task) as sandbox:
            for i, call in enumerate(plan.calls):
                execute(sandbox, call)
                if i == edits[0]:
                    snapshot = sandbox.snapshot()
                    with engine.restore(snapshot) as fork:
                        assert verify(fork, task).reward == 0.0
                    engine.release(snapshot)
            assert verify(sandbox, task).reward == 1.0
    assert kinds == {"wrong_fix", "lookalike"}


def test_error_rate_zero_never_errs(tasks, engine):
    for task in tasks:
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=0, config=ExpertConfig(error_rate=0.0))
        assert plan.wrong_edit is None
        assert sum(c.name == "edit_file" for c in plan.calls) == len(fix_edits(task))


def test_line_views_show_each_edit_exactly_its_lines(tasks, engine):
    for task, seed in ((tasks[0], 0), (tasks[1], 0), (tasks[1], 1)):
        with engine.start(task) as sandbox:
            plain = explore_script(task, sandbox, seed=seed, config=ExpertConfig(error_rate=1.0))
            viewing = explore_script(task, sandbox, seed=seed, config=ExpertConfig(error_rate=1.0, p_line_view=1.0))
        assert not any(c.name == "view_file" and "end" in c.arguments for c in plain.calls)
        observations, result = play(engine, task, viewing.calls)
        assert result.reward == 1.0
        for i, call in enumerate(viewing.calls):
            a = call.arguments
            if call.name == "edit_file" and a["end"] >= a["start"]:   # each edit that replaces lines (wrong
                view = viewing.calls[i - 1]                           # ones too) right after a view of them
                assert view.name == "view_file" and view.arguments == {"path": a["path"], "start": a["start"],
                                                                       "end": a["end"]}
                assert not observations[i - 1].is_error
                shown = re.findall(r"^ *(\d+)\t", observations[i - 1].text, re.MULTILINE)
                assert [int(n) for n in shown] == list(range(a["start"], a["end"] + 1))


def test_sed_edits_solve_the_task_and_write_only_the_changed_fragment(tasks, engine):
    """p_sed: every one-line edit (a wrong one and its repair too) is a `sed -i 'Ns/OLD/NEW/'` run in the
    sandbox and the episode still solves the task; without a wrong edit the one substitution names only the
    changed fragment. An insertion (task 0's fix adds two lines) stays an edit_file call."""
    for task, seed, error_rate in ((tasks[0], 0, 1.0), (tasks[1], 0, 0.0), (tasks[1], 0, 1.0), (tasks[1], 1, 1.0)):
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=seed, config=ExpertConfig(error_rate=error_rate, p_sed=1.0))
        seds = [c.arguments["command"] for c in plan.calls
                if c.name == "run_shell" and c.arguments["command"].startswith("sed -i")]
        _, result = play(engine, task, plan.calls)
        assert result.reward == 1.0
        gold = next(c.arguments for c in fix_edits(task) if c.name == "edit_file")
        if gold["start"] > gold["end"]:
            assert not seds and any(c.name == "edit_file" for c in plan.calls)
            continue
        assert seds and not any(c.name == "edit_file" for c in plan.calls)
        if plan.wrong_edit is None:
            assert seds == [f"sed -i '{gold['start']}s/{{}}, name/name, {{}}/' {gold['path']}"]
        else:
            assert len(seds) >= 2


def test_def_edits_start_at_the_def_line_and_solve_the_task(tasks, engine):
    """p_def_edit: every edit that replaces lines inside a function (a wrong one and its repair too) starts at
    the function's def line, rewriting the lines above the change as they are; the episode still solves the
    task. An insertion (task 0's fix adds two lines) stays as it is."""
    widened = 0
    for task, seed, error_rate in ((tasks[0], 0, 0.0), (tasks[1], 0, 0.0), (tasks[1], 0, 1.0), (tasks[1], 1, 1.0)):
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=seed, config=ExpertConfig(error_rate=error_rate, p_def_edit=1.0))
            texts = {c.arguments["path"]: sandbox.read_file(c.arguments["path"]).decode()
                     for c in plan.calls if c.name == "edit_file"}
        observations, result = play(engine, task, plan.calls)
        assert result.reward == 1.0 and not any(o.is_error for o in observations)
        gold = next(c.arguments for c in fix_edits(task) if c.name == "edit_file")
        fix = None
        for call in plan.calls:
            a = call.arguments
            if call.name != "edit_file":
                continue
            if a["start"] > a["end"]:
                assert not a["replacement"].startswith("def ")
                continue
            lines = texts[a["path"]].splitlines(keepends=True)
            assert lines[a["start"] - 1].startswith("def ") and a["replacement"].startswith(lines[a["start"] - 1])
            if a["path"] == gold["path"] and a["end"] == gold["end"]:
                fix = (a, "".join(lines[a["start"] - 1:gold["start"] - 1]))  # the last one is the fix
        if gold["start"] <= gold["end"]:
            assert fix is not None, "no edit of the gold lines"
            a, head = fix
            assert a["start"] < gold["start"] and a["replacement"] == head + gold["replacement"]
            widened += 1
    assert widened >= 2


def test_sed_command_matches_sed_on_every_bug_family(tmp_path):
    """The command, run by the real sed, turns each nano mutant's buggy line back into the original."""
    import random
    import subprocess

    from crr.agent.tools import split_lines
    from crr.tasks.bugs import mutants
    from crr.tasks.nano import NANO_FAMILIES, nano_template

    rng, checked, families = random.Random(0), 0, set()
    (tmp_path / "pkg").mkdir()
    for _ in range(40):
        template = nano_template(rng, rng.choice(["train", "test"]))
        for module in template.modules:
            for family in NANO_FAMILIES:
                for bug in mutants(module.source, family, rng)[:2]:
                    old, new = split_lines(bug.source), split_lines(module.source)
                    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
                    if len(old) != len(new) or len(changed) != 1:
                        continue
                    line = changed[0] + 1
                    command = sed_command("pkg/mod.py", line, old[line - 1], new[line - 1])
                    assert command is not None, (old[line - 1], new[line - 1])
                    (tmp_path / "pkg/mod.py").write_text(bug.source)
                    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
                    assert (tmp_path / "pkg/mod.py").read_text() == module.source, command
                    _, before, after, path = parse_sed(command)   # the reading the eval figures use
                    assert old[line - 1].replace(before, after, 1) == new[line - 1] and path == "pkg/mod.py"
                    checked += 1
                    families.add(family)
    assert checked > 200 and families == set(NANO_FAMILIES)
    # regex syntax in the fragment is escaped; a fragment with a quote has no plain command
    assert sed_command("m.py", 3, "    return x[:4 - 1]\n", "    return x[:4]\n") == "sed -i '3s/ - 1//' m.py"
    assert sed_command("m.py", 1, "a = b.c * 2", "a = b.c * 3") == "sed -i '1s/2/3/' m.py"
    assert sed_command("m.py", 1, "a = b * c", "a = b / c") == "sed -i '1s/\\*/\\//' m.py"
    assert sed_command("m.py", 1, "a = 'x'", "a = 'x' + 'y'") is None
    assert sed_command("m.py", 1, "a = 1", "a = 1") is None
    assert parse_sed("sed -i '1s/\\*/\\//' m.py") == (1, "*", "/", "m.py")
    assert parse_sed("sed -i 's/a/b/' m.py") is None


def test_expert_is_deterministic_per_seed(tasks, engine):
    task = tasks[1]
    plans = []
    for seed in (0, 0, 1, 2):
        with engine.start(task) as sandbox:
            plans.append([call_json(c) for c in explore_script(task, sandbox, seed=seed).calls])
    assert plans[0] == plans[1]
    assert plans[0] != plans[2] or plans[0] != plans[3]


def test_expert_without_a_reproducible_issue(make_task, engine):
    """A non-micro task (no call in the issue): the expert falls back to focused tests and still solves it."""
    task = calc_task(make_task)
    assert parse_issue_call(task.problem_statement) is None
    with engine.start(task) as sandbox:
        plan = explore_script(task, sandbox, seed=0, config=ExpertConfig(error_rate=1.0))
    _, result = play(engine, task, plan.calls)
    assert result.reward == 1.0
    assert fix_edits(task)[0].arguments == {"path": "calc.py", "start": 2, "end": 2,
                                            "replacement": "    return a + b\n"}


@pytest.mark.parametrize("issue, expected", [
    ("t\n\n```python\n>>> from pkg.mod import f\n>>> f('a', [1])\n3\n```\n", ("pkg.mod", "f", "f('a', [1])")),
    ("t\n\n```python\nfrom pkg.mod import f\nprint(f((1, 2)))\n```\n", ("pkg.mod", "f", "f((1, 2))")),
    ("t\n\nCalling `pkg.sub.mod.f(0, 'x')` returns `1`. I expected `2`.", ("pkg.sub.mod", "f", "f(0, 'x')")),
    ("add() subtracts\nadd(2, 3) returns -1 instead of 5.", None),
])
def test_parse_issue_call(issue, expected):
    got = parse_issue_call(issue)
    assert (got and (got.module, got.function, got.call)) == expected


def test_bad_expert_config():
    from crr.errors import CRRError

    with pytest.raises(CRRError, match="error_rate"):
        ExpertConfig(error_rate=1.5)
