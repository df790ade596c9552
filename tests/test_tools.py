"""The five tools, tool-call parsing, truncation, tool-type scores and model_patch, on a real git
repository in the local fork engine and in Docker."""

from __future__ import annotations

import json
import time

import pytest

from agent_tasks import CALC, CALC_FIXED, TESTS
from crr.agent.prompt import SYSTEM_PROMPT, TOOL_SCHEMAS, system_prompt, user_prompt
from crr.agent.tools import (OBS_KEEP_CHARS, ToolCall, ToolCallError, execute, model_patch, parse_tool_call,
                             tool_type_score, truncate)
from crr.sandbox import get_engine


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def engine(request):
    eng = get_engine(request.param)
    yield eng
    eng.close()


@pytest.fixture
def sandbox(engine, task):
    with engine.start(task) as sb:
        yield sb


def call(sb, name: str, **arguments):
    return execute(sb, ToolCall(name, arguments))


# ----------------------------------------------------------------------------- prompt and schemas

def test_system_prompt_is_the_papers_and_takes_the_turn_cap():
    assert SYSTEM_PROMPT.startswith("You are an autonomous software engineer working in a containerised")
    assert "view_file, edit_file, run_shell, run_tests, submit_patch" in SYSTEM_PROMPT
    assert "submit_patch or after 50 turns. Read carefully before editing" in SYSTEM_PROMPT
    assert "after 8 turns." in system_prompt(8)


def test_user_prompt_has_title_body_and_workdir(task):
    text = user_prompt(task, "/testbed")
    assert "Issue title: add() subtracts" in text
    assert "add(2, 3) returns -1 instead of 5." in text
    assert "/testbed" in text


def test_tool_schemas_are_function_calling_schemas():
    names = [t["function"]["name"] for t in TOOL_SCHEMAS]
    assert names == ["view_file", "edit_file", "run_shell", "run_tests", "submit_patch"]
    for tool in TOOL_SCHEMAS:
        assert tool["type"] == "function"
        params = tool["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
    edit = TOOL_SCHEMAS[1]["function"]["parameters"]["properties"]
    assert edit["start"]["type"] == edit["end"]["type"] == "integer"
    assert edit["replacement"]["type"] == edit["path"]["type"] == "string"
    json.dumps(TOOL_SCHEMAS)  # plain JSON, as chat templates and grammar compilers need


# ----------------------------------------------------------------------------- parsing

def test_parse_bare_and_wrapped_tool_calls():
    bare = parse_tool_call('{"name": "view_file", "arguments": {"path": "calc.py"}}')
    wrapped = parse_tool_call('<think>look first</think>\n<tool_call>\n{"name": "view_file", '
                              '"arguments": {"path": "calc.py", "start": 1}}\n</tool_call>')
    assert bare == ToolCall("view_file", {"path": "calc.py"})
    assert bare.canonical() == wrapped.canonical()  # the default start=1 is the same action
    assert parse_tool_call('{"name": "submit_patch"}') == ToolCall("submit_patch", {})


@pytest.mark.parametrize("text, reason", [
    ("view_file calc.py", "not valid JSON"),
    ('{"name": "view_file", "arguments": {"path": "calc.py"}', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'"),
    ('{"name": "view_file", "arguments": {}}', "missing required argument(s) ['path']"),
    ('{"name": "view_file", "arguments": {"path": "a", "lines": 3}}', "unexpected argument(s) ['lines']"),
    ('{"name": "view_file", "arguments": {"path": "a", "start": "3"}}', "must be an integer, got a string"),
    ('{"name": "view_file", "arguments": {"path": "a", "start": true}}', "must be an integer, got a boolean"),
    ('{"name": "view_file", "arguments": {"path": "a", "start": 0}}', "must be >= 1"),
    ('{"name": "run_shell", "arguments": {"command": "ls", "timeout": 100000}}', "must be <= 600"),
    ('{"name": "run_shell", "arguments": "ls"}', "'arguments' must be a JSON object"),
    ('{"name": "run_shell", "arguments": {"command": "echo \\u0000"}}', "contains a NUL"),
    ('{"name": "view_file", "arguments": {"path": "calc\\u0000.py"}}', "contains a NUL"),
    ('{"name": "edit_file", "arguments": {"path": "a", "start": 1, "end": 0, "replacement": "\\ud800"}}',
     "unpaired surrogate"),
    ('{"tool": "run_shell", "arguments": {"command": "ls"}}', "unexpected key(s) ['tool']"),
    ('<tool_call>{"name": "submit_patch"}</tool_call><tool_call>{"name": "submit_patch"}</tool_call>',
     "emit exactly one per turn"),
])
def test_bad_calls_are_error_observations_not_crashes(sandbox, text, reason):
    with pytest.raises(ToolCallError) as err:
        parse_tool_call(text)
    assert reason in str(err.value)
    obs = execute(sandbox, text)
    assert obs.is_error and not obs.terminal and reason in obs.text


def test_a_constructed_call_is_validated_too(sandbox):
    bad = ToolCall("edit_file", {"path": "calc.py", "start": 1.5, "end": 1, "replacement": ""})
    obs = execute(sandbox, bad)
    assert obs.is_error and "must be an integer, got a number" in obs.text


# ----------------------------------------------------------------------------- view_file

def test_view_file_windows_and_line_numbers(sandbox):
    sandbox.write_file("long.txt", "".join(f"line {i}\n" for i in range(1, 251)).encode())
    first = call(sandbox, "view_file", path="long.txt")
    assert not first.is_error
    lines = first.text.splitlines()
    assert lines[0] == "long.txt: lines 1-200 of 250"
    assert lines[1] == "     1\tline 1" and lines[200] == "   200\tline 200"
    assert lines[-1] == "[50 more lines; view_file with start=201 to continue]"
    tail = call(sandbox, "view_file", path="long.txt", start=240, end=400)
    assert tail.text.splitlines()[0] == "long.txt: lines 240-250 of 250"
    assert tail.text.splitlines()[-1] == "   250\tline 250"
    middle = call(sandbox, "view_file", path="/" + sandbox.repo_dir.strip("/") + "/long.txt", start=5, end=6)
    assert middle.text == "long.txt: lines 5-6 of 250\n     5\tline 5\n     6\tline 6\n[244 more lines; " \
                          "view_file with start=7 to continue]\n"


@pytest.mark.parametrize("args, reason", [
    ({"path": "calc.py", "start": 7}, "start=7 is past the end of calc.py (6 lines)"),
    ({"path": "calc.py", "start": 4, "end": 2}, "end=2 is before start=4"),
    ({"path": "nope.py"}, "nope.py does not exist"),
    ({"path": "tests"}, "tests is a directory"),
    ({"path": "../outside.py"}, "outside the repository"),
    ({"path": "/etc/passwd"}, "outside the repository"),
    ({"path": "calc.py/../../x"}, "outside the repository"),
])
def test_view_file_errors(sandbox, args, reason):
    obs = call(sandbox, "view_file", **args)
    assert obs.is_error and reason in obs.text


def test_a_link_out_of_the_repository_is_an_error_observation(sandbox):
    call(sandbox, "run_shell", command="ln -s /etc/hostname host && ln -s /etc/hostname host2")
    obs = call(sandbox, "view_file", path="host")
    assert obs.is_error and "cannot be read" in obs.text
    obs = call(sandbox, "edit_file", path="host2", start=1, end=0, replacement="x")
    assert obs.is_error


# ----------------------------------------------------------------------------- edit_file

def test_edit_file_replaces_a_range_and_returns_a_diff(sandbox):
    obs = call(sandbox, "edit_file", path="calc.py", start=2, end=2, replacement="    return a + b")
    assert not obs.is_error
    assert obs.text.startswith("--- a/calc.py\n+++ b/calc.py\n@@ -1,5 +1,5 @@\n")
    assert "-    return a - b\n+    return a + b\n" in obs.text
    assert sandbox.read_file("calc.py").decode() == CALC_FIXED


def test_edit_file_inserts_appends_deletes_and_creates(sandbox):
    call(sandbox, "edit_file", path="calc.py", start=1, end=0, replacement='"""Arithmetic."""\n\n')
    assert sandbox.read_file("calc.py").decode() == '"""Arithmetic."""\n\n' + CALC
    call(sandbox, "edit_file", path="calc.py", start=9, end=8, replacement="\n\nZERO = 0")
    assert sandbox.read_file("calc.py").decode().endswith("return a * b\n\n\nZERO = 0\n")
    call(sandbox, "edit_file", path="calc.py", start=1, end=2, replacement="")
    assert sandbox.read_file("calc.py").decode().startswith("def add(a, b):")
    created = call(sandbox, "edit_file", path="pkg/new/mod.py", start=1, end=0, replacement="X = 1\n")
    assert created.text.startswith("--- /dev/null\n+++ b/pkg/new/mod.py\n") and "+X = 1" in created.text
    assert sandbox.read_file("pkg/new/mod.py") == b"X = 1\n"
    same = call(sandbox, "edit_file", path="calc.py", start=1, end=1, replacement="def add(a, b):\n")
    assert not same.is_error and same.text.startswith("No change")


@pytest.mark.parametrize("args, reason", [
    ({"path": "calc.py", "start": 8, "end": 7}, "start=8 is past the end of calc.py (6 lines; start=7"),
    ({"path": "calc.py", "start": 2, "end": 9}, "end=9 is past the end of calc.py (6 lines)"),
    ({"path": "calc.py", "start": 4, "end": 2}, "end=2 is before start=4"),
    ({"path": "new.py", "start": 2, "end": 2}, "new.py does not exist; create it with start=1, end=0"),
    ({"path": "../x.py", "start": 1, "end": 0}, "outside the repository"),
    ({"path": ".git/config", "start": 1, "end": 1}, "files under .git cannot be edited"),
])
def test_edit_file_errors_leave_the_file_alone(sandbox, args, reason):
    obs = call(sandbox, "edit_file", replacement="BROKEN\n", **args)
    assert obs.is_error and reason in obs.text
    assert sandbox.read_file("calc.py").decode() == CALC


# ----------------------------------------------------------------------------- run_shell / run_tests

def test_run_shell_runs_in_the_repository_root(sandbox):
    obs = call(sandbox, "run_shell", command="ls calc.py && exit 3")
    assert obs.text == "calc.py\n[exit code: 3]" and not obs.is_error
    assert call(sandbox, "run_shell", command="   ").is_error


def test_run_shell_timeout_is_a_bounded_observation(sandbox):
    t0 = time.monotonic()
    obs = call(sandbox, "run_shell", command="echo started; sleep 60", timeout=1)
    assert time.monotonic() - t0 < 30
    assert obs.text.startswith("started\n") and not obs.is_error
    assert obs.text.endswith("\n[timed out after 1 s; the command was killed]")


def test_a_command_that_prints_forever_is_bounded(sandbox):
    obs = call(sandbox, "run_shell", command="yes", timeout=2)
    assert obs.text.startswith("y\ny\n") and "characters elided" in obs.text
    assert obs.text.endswith("[timed out after 2 s; the command was killed]")
    assert len(obs.text) < 2 * OBS_KEEP_CHARS + 200


def test_a_flood_of_output_is_truncated_deterministically(sandbox):
    command = "python3 -c \"print(''.join(str(i % 10) for i in range(300000)))\""
    first, second = (call(sandbox, "run_shell", command=command) for _ in range(2))
    assert first == second
    assert "characters elided ...]" in first.text and len(first.text) < 2 * OBS_KEEP_CHARS + 200
    assert first.text.startswith("0123456789") and first.text.endswith("456789\n[exit code: 0]")


def test_truncate_keeps_head_and_tail():
    text = "a" * 5000 + "b" * 5000
    cut = truncate(text, keep=100)
    assert cut == "a" * 100 + "\n[... 9800 characters elided ...]\n" + "b" * 100
    assert truncate("short", keep=100) == "short"


def test_run_tests_runs_the_canonical_runner_with_a_filter(sandbox):
    call(sandbox, "edit_file", path="tests/test_calc.py", start=6, end=5,
         replacement="\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    whole = call(sandbox, "run_tests")
    assert "FAILED tests/test_calc.py::test_add" in whole.text
    assert "PASSED tests/test_calc.py::test_mul" in whole.text
    assert whole.text.endswith("[exit code: 1]")
    by_id = call(sandbox, "run_tests", test_filter="tests/test_calc.py::test_mul")
    assert "1 passed" in by_id.text and "test_add" not in by_id.text and by_id.text.endswith("[exit code: 0]")
    by_k = call(sandbox, "run_tests", test_filter="-k 'add and not mul'")
    assert "1 failed, 1 deselected" in by_k.text and "PASSED" not in by_k.text


def test_run_tests_filter_cannot_inject_shell_or_options(sandbox):
    obs = call(sandbox, "run_tests", test_filter="tests/test_calc.py; touch pwned")
    assert not obs.is_error
    assert call(sandbox, "run_shell", command="test -e pwned").text == "[exit code: 1]"
    for bad in ("--rootdir=/", "-p no:cov", "'unbalanced"):
        assert call(sandbox, "run_tests", test_filter=bad).is_error


def test_submit_patch_is_terminal(sandbox):
    obs = call(sandbox, "submit_patch")
    assert obs.terminal and not obs.is_error


def test_identical_states_give_identical_observations(engine, task):
    calls = [ToolCall("view_file", {"path": "calc.py"}),
             ToolCall("run_shell", {"command": "git status --short"}),
             ToolCall("edit_file", {"path": "calc.py", "start": 2, "end": 2, "replacement": "  return 0"}),
             ToolCall("view_file", {"path": "nope"}),
             ToolCall("run_shell", {"command": "cat calc.py"})]
    with engine.start(task) as a, engine.start(task) as b:
        assert [execute(a, c) for c in calls] == [execute(b, c) for c in calls]


# ----------------------------------------------------------------------------- tool-type score

@pytest.mark.parametrize("name, arguments, score", [
    ("view_file", {"path": "a.py"}, 0.0),
    ("run_shell", {"command": "grep -rn 'def add' . | head -5"}, 0.0),
    ("run_shell", {"command": "find . -name '*.py' | wc -l"}, 0.0),
    ("run_shell", {"command": "sed -n '1,20p' calc.py && git log --oneline -3"}, 0.0),
    ("run_shell", {"command": "ls tests; cat calc.py; rg add; tail -n 3 calc.py; git diff; git status"}, 0.0),
    ("run_shell", {"command": "sed -i 's/-/+/' calc.py"}, 0.75),
    ("run_shell", {"command": "cat calc.py > copy.py"}, 0.75),
    ("run_shell", {"command": "find . -name '*.pyc' -delete"}, 0.75),
    ("run_shell", {"command": "grep add $(rm calc.py)"}, 0.75),
    ("run_shell", {"command": "git checkout -- calc.py"}, 0.75),
    ("run_shell", {"command": "python3 -c 'print(1)'"}, 0.75),
    ("run_tests", {"test_filter": "-k add"}, 0.25),
    ("edit_file", {"path": "a.py", "start": 1, "end": 1, "replacement": "x"}, 1.0),
    ("submit_patch", {}, None),
])
def test_tool_type_score_table(name, arguments, score):
    assert tool_type_score(ToolCall(name, arguments)) == score


# ----------------------------------------------------------------------------- model_patch

def test_model_patch_has_new_files_and_leaves_the_index_alone(engine, task, sandbox):
    git_state = "git status --porcelain --untracked-files=all; sha256sum .git/index; git diff --cached --stat"
    call(sandbox, "edit_file", path="calc.py", start=2, end=2, replacement="    return a + b")
    call(sandbox, "edit_file", path="docs/notes.md", start=1, end=0, replacement="# notes")
    call(sandbox, "run_shell", command="rm README.md && python3 -c 'import calc' && ls __pycache__")
    before = call(sandbox, "run_shell", command=git_state).text
    patch = model_patch(sandbox)
    assert call(sandbox, "run_shell", command=git_state).text == before
    assert "+++ b/docs/notes.md" in patch and "+# notes" in patch
    assert "-    return a - b\n+    return a + b" in patch
    assert "deleted file mode" in patch and "__pycache__" not in patch
    with engine.start(task) as fresh:  # the patch reproduces the state from base_commit
        fresh.write_file("agent.patch", patch.encode())
        applied = call(fresh, "run_shell", command="git apply agent.patch && rm agent.patch")
        assert applied.text == "[exit code: 0]"
        assert fresh.read_file("calc.py").decode() == CALC_FIXED
        assert fresh.read_file("docs/notes.md") == b"# notes\n"
        assert call(fresh, "run_shell", command="test -e README.md").text == "[exit code: 1]"


def test_model_patch_is_empty_without_changes(sandbox):
    assert model_patch(sandbox) == ""
    assert sandbox.read_file("tests/test_calc.py").decode() == TESTS


# ----------------------------------------------------------------------------- crr tool

def test_crr_tool_runs_a_script_and_verifies(tmp_path, task):
    from typer.testing import CliRunner

    from crr.cli import app
    from crr.tasks.loaders import write_tasks

    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    script = tmp_path / "calls.jsonl"
    script.write_text('{"name": "view_file", "arguments": {"path": "calc.py", "end": 2}}\n'
                      'not json\n'
                      '{"name": "edit_file", "arguments": {"path": "calc.py", "start": 2, "end": 2, '
                      '"replacement": "    return a + b"}}\n'
                      '{"name": "submit_patch", "arguments": {}}\n'
                      '{"name": "run_shell", "arguments": {"command": "echo after the episode"}}\n')
    runner = CliRunner()
    result = runner.invoke(app, ["tool", "--tasks", str(tasks), "--instance", task.instance_id,
                                 "--script", str(script), "--verify", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    steps = out["steps"]
    assert [s["is_error"] for s in steps] == [False, True, False, False]  # stops at submit_patch
    assert steps[0]["observation"].startswith("calc.py: lines 1-2 of 6")
    assert out["verifier"]["reward"] == 1.0 and out["verifier"]["infra_error"] is None

    shown = runner.invoke(app, ["tool", "--tasks", str(tasks), "--instance", task.instance_id,
                                "--call", '{"name": "view_file", "arguments": {"path": "README.md"}}'])
    assert shown.exit_code == 0 and "view_file" in shown.stdout and "calc" in shown.stdout

    unknown = runner.invoke(app, ["tool", "--tasks", str(tasks), "--instance", "nope", "--call", "{}"])
    assert unknown.exit_code == 2
    assert "no task 'nope'" in unknown.output and task.instance_id in unknown.output


def test_test_runner_durations_are_masked_so_equal_states_read_equal():
    from crr.agent.tools import normalise_durations

    assert normalise_durations("== 3 passed in 0.02s ==") == normalise_durations("== 3 passed in 1.97s ==")
    assert normalise_durations("= 9 passed in 74.70s (0:01:14) =") == "= 9 passed in <t>s ="
    assert normalise_durations("Ran 3 tests in 0.004s\nOK") == "Ran 3 tests in <t>s\nOK"
    assert normalise_durations("cached in 5seconds") == "cached in 5seconds"
