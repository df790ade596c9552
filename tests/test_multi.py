"""The multi tier (several bugs, symptom-only issues, look-alike modules) and the named sets' validation splits:
real git repositories, real pytest runs, the expert's episodes played through the tools and graded by the
verifier."""

from __future__ import annotations

import hashlib
import random
import re
import subprocess

import pytest
from typer.testing import CliRunner
from unidiff import PatchSet

from crr.agent.expert import MULTI_MAX_DECISIONS, ExpertConfig, call_json, explore_script, fix_edits
from crr.agent.tools import execute
from crr.agent.verifier import verify
from crr.cli import app
from crr.errors import CRRError
from crr.sandbox import get_engine
from crr.tasks.loaders import MICRO_DEFAULT_N, MICRO_RANGES, MICRO_SETS, TASK_SETS, load_tasks
from crr.tasks.micro import generate_micro
from crr.tasks.multi import ISSUE_STYLES, Knobs, multi_template


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    # seed 0's first five tasks: (3 bugs, test_id), (1, test_id), (1, named), (2, named), (3, symptom)
    return generate_micro(tmp_path_factory.mktemp("multi") / "train", n=5, seed=0, split="train", tier="multi",
                          workers=2)


@pytest.fixture(scope="module")
def engine():
    eng = get_engine("local")
    yield eng
    eng.close()


def test_rows_record_their_knobs_and_hold_every_bug_in_its_own_module(tasks, tmp_path):
    assert {t.metadata["n_bugs"] for t in tasks} == {1, 2, 3}
    assert {t.metadata["issue_style"] for t in tasks} == set(ISSUE_STYLES)
    for task in tasks:
        m = task.metadata
        assert task.instance_id.startswith("multi-train-0-") and m["tier"] == "multi" and task.repo == "crr/multi"
        bugs = m["bugs"]
        files = [p.path for p in PatchSet(task.patch)]
        assert len(bugs) == m["n_bugs"] and sorted(files) == sorted(b["file"] for b in bugs)
        assert all(len(list(p)) == 1 and sum(h.added for h in p) == 1 for p in PatchSet(task.patch))  # one line each
        # each bug's visible failing test (and at least one held-out one) is in FAIL_TO_PASS
        for bug in bugs:
            assert bug["test"] in task.FAIL_TO_PASS and bug["test"] not in task.test_patch
            stem = bug["file"].rsplit("/", 1)[1]
            assert any(t.startswith(f"tests/test_{stem}::") and t != bug["test"] for t in task.FAIL_TO_PASS)
        # the issue at its setting's detail
        text, package = task.problem_statement, m["package"]
        for bug in bugs:
            module = bug["file"][:-3].replace("/", ".")
            if m["issue_style"] == "named":
                assert f"`{module}.{bug['function']}(" in text
            elif m["issue_style"] == "symptom":
                assert f"`{bug['function']}(" in text and f"{module}." not in text and "I expected" in text
            else:
                assert f"`{bug['test']}` fails." in text and "returns" not in text and "expected" not in text
        # look-alike modules: near-identical names, correct code (never in the patch), tested
        clone = tmp_path / task.instance_id
        subprocess.run(["git", "clone", "-q", task.repo_src, str(clone)], check=True, capture_output=True)
        assert m["n_distractors"] == len(m["distractors"]) >= 1
        for path in m["distractors"]:
            assert path not in files and (clone / path).is_file()
            assert (clone / "tests" / f"test_{path.rsplit('/', 1)[1]}").is_file()
            stem = path.rsplit("/", 1)[1][:-3]
            modules = [p.stem for p in (clone / package).glob("*.py") if p.stem not in (stem, "__init__")]
            assert any(_near(stem, other) for other in modules), (stem, modules)


def _near(a: str, b: str) -> bool:
    """One letter added, dropped or changed."""
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def test_the_expert_solves_in_5_to_12_decisions_and_partial_fixes_score_0(tasks, engine):
    lengths = []
    for task in tasks:
        m = task.metadata
        # the (1 bug, named) task errs: a wrong fix, shown wrong by the tests, then repaired
        erring = (m["n_bugs"], m["issue_style"]) == (1, "named")
        with engine.start(task) as sandbox:
            plan = explore_script(task, sandbox, seed=0, config=ExpertConfig(error_rate=1.0) if erring else None)
        calls, names = plan.calls, [c.name for c in plan.calls]
        lengths.append(len(calls))
        assert 5 <= len(calls) <= MULTI_MAX_DECISIONS, [call_json(c) for c in calls]
        assert names[0] == "run_tests" and names[-1] == "submit_patch"
        with engine.start(task) as sandbox:
            observations = [execute(sandbox, c) for c in calls]
            assert verify(sandbox, task).reward == 1.0, (task.instance_id, [call_json(c) for c in calls])
        assert not any(o.is_error for o in observations)
        # the first test run shows every bug's failing test; the symptom and test_id issues are found by a grep
        for bug in m["bugs"]:
            assert f"FAILED {bug['test']}" in observations[0].text
        # in pytest's short summary (RUN_TESTS_CMD): no session header, no PASSED line per test as the verifier's -rA
        assert "test session starts" not in observations[0].text and "PASSED" not in observations[0].text
        assert task.test_cmd != task.run_tests_cmd and "-rA" in task.test_cmd
        greps = [c for c in calls if c.name == "run_shell" and "grep" in c.arguments["command"]]
        assert len(greps) == (0 if m["issue_style"] == "named" else m["n_bugs"])
        if m["issue_style"] == "named":   # p_grep_named: the named style located as the others are
            with engine.start(task) as sandbox:
                located = explore_script(task, sandbox, seed=0,
                                         config=ExpertConfig(p_grep_named=1.0, max_decoy_views=0)).calls
                assert [c.name for c in located][1:3] == ["run_shell", "view_file"], [call_json(c) for c in located]
                assert sum("grep" in c.arguments.get("command", "") for c in located) == m["n_bugs"]
                assert len(located) <= MULTI_MAX_DECISIONS
                seen = task.problem_statement
                for c in located:   # every path it names was in its context before (a grep's hit)
                    assert c.arguments.get("path", "") in seen, (c.arguments, seen)
                    obs = execute(sandbox, c)
                    assert not obs.is_error
                    seen += obs.text
                assert verify(sandbox, task).reward == 1.0
        if erring:
            first_edit = names.index("edit_file")
            assert plan.wrong_edit == "wrong_fix" and names[first_edit + 1:first_edit + 3] == ["run_tests", "edit_file"]
            assert "1 failed" in observations[first_edit + 1].text
        # every fix but one: reward 0 (binary, as in the paper; unfixed fails by the measured FAIL_TO_PASS)
        fixes = fix_edits(task)
        if len(fixes) > 1:
            left_out = random.Random(task.instance_id).randrange(len(fixes))
            with engine.start(task) as sandbox:
                for i, fix in enumerate(fixes):
                    if i != left_out:
                        assert not execute(sandbox, fix).is_error
                assert verify(sandbox, task).reward == 0.0
    assert max(lengths) > min(lengths)


def test_knobs_cycle_in_equal_shares_and_bad_knobs_are_clear_errors(tmp_path):
    knobs = Knobs()
    draws = [knobs.draw(i, 0, "train") for i in range(18)]
    assert sorted(draws) == sorted([(b, s) for b in (1, 2, 3) for s in ISSUE_STYLES] * 2)
    assert Knobs.parse("2", "symptom", 0).draw(5, 0, "test") == (2, "symptom")
    for bad, match in ((lambda: Knobs.parse("1,4", "named", 2), "--bugs"),
                       (lambda: Knobs.parse("x", "named", 2), "--bugs"),
                       (lambda: Knobs.parse("1", "vague", 2), "--issue"),
                       (lambda: Knobs(distractors=9), "--distractors")):
        with pytest.raises(CRRError, match=match):
            bad()
    with pytest.raises(CRRError, match="multi tier's knobs"):
        generate_micro(tmp_path / "a", n=1, seed=0, split="train", tier="nano", knobs=Knobs())
    with pytest.raises(CRRError, match="train and test splits only"):
        generate_micro(tmp_path / "b", n=1, seed=0, split="val")
    # without distractors, no look-alike module; the names still come from the split's vocabulary
    template, core = multi_template(random.Random(1), "test", 3, 0)
    assert {m.name for m in template.modules} == core and len(core) == 3
    # the CLI: knobs in, recorded in the row; a bad knob exits 2 with one line
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(app, ["tasks", "micro", "--tier", "multi", "--split", "val", "--n", "1", "--bugs", "2",
                                 "--issue", "symptom", "--distractors", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "bugs x issue style: 2 symptom: 1" in result.output
    (task,) = load_tasks(str(out))
    assert (task.metadata["n_bugs"], task.metadata["issue_style"], task.metadata["n_distractors"]) == (2, "symptom", 0)
    assert task.instance_id == "multi-val-0-0"
    result = runner.invoke(app, ["tasks", "micro", "--tier", "multi", "--n", "1", "--issue", "vague",
                                 "--out", str(tmp_path / "bad")])
    assert result.exit_code == 2 and "--issue takes styles among named, symptom, test_id" in result.output


def test_the_catalogue_names_disjoint_ranges_and_crr_eval_reads_it():
    assert set(MICRO_SETS) <= set(TASK_SETS)
    # nano-test keeps meaning what the committed results evaluated (tasks 0-63); nano-dev names the same tasks
    assert MICRO_SETS["nano-test"] == MICRO_SETS["nano-dev"] == ("nano", "test")
    assert "nano-test" not in MICRO_RANGES and "nano-dev" not in MICRO_RANGES and MICRO_DEFAULT_N["nano"] == 64

    def indices(name):
        first, n = MICRO_RANGES.get(name, (0, MICRO_DEFAULT_N[MICRO_SETS[name][0]]))
        return set(range(first, first + n))

    names = sorted(MICRO_SETS)
    for a in names:
        for b in names:
            if a < b and MICRO_SETS[a] == MICRO_SETS[b] and {a, b} != {"nano-test", "nano-dev"}:
                assert not indices(a) & indices(b), (a, b)
    assert len(indices("multi-test")) >= 256 and len(indices("nano-test2")) >= 256


def test_train_val_and_test_instances_are_disjoint_by_id_and_content(tasks, tmp_path):
    """The named sets' first tasks (and the nano test ranges' first), generated as the catalogue does; a
    repository and bug is identified by base_commit (a hash of the content) and the gold patch."""
    def sample(tier, split, first=0, n=1):
        return generate_micro(tmp_path / f"{tier}-{split}-{first}", n=n, seed=0, split=split, tier=tier, first=first)

    sets = {"multi-train": tasks, "multi-val": sample("multi", "val"), "multi-test": sample("multi", "test"),
            "nano-train": sample("nano", "train"), "nano-val": sample("nano", "val"),
            "nano-dev": sample("nano", "test"),
            "nano-test2": sample("nano", "test", first=MICRO_RANGES["nano-test2"][0])}
    ids, contents = {}, {}
    for name, members in sets.items():
        for t in members:
            ids.setdefault(t.instance_id, []).append(name)
            key = hashlib.sha256(f"{t.base_commit}\n{t.patch}".encode()).hexdigest()
            contents.setdefault(key, []).append(name)
    assert all(len(v) == 1 for v in ids.values()) and all(len(v) == 1 for v in contents.values())
    assert [t.instance_id for t in sets["nano-test2"]] == ["nano-test-0-64"]
    assert all(re.fullmatch(r"(nano|multi)-val-0-\d", t.instance_id) for t in sets["nano-val"] + sets["multi-val"])
