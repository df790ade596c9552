"""The micro task set: bug families as AST transforms, deterministic generation, measured
FAIL_TO_PASS/PASS_TO_PASS that really hold, flaky tests that really flake, and `crr tasks micro`."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.sandbox.checkout import base_checkout
from crr.tasks.bugs import FAMILIES, mutants
from crr.tasks.loaders import load_tasks
from crr.tasks.micro import FLAKY_KINDS, _Case, _package_files, _probe, generate_micro
from crr.tasks.schema import Task
from crr.tasks.templates import FILLERS, TEMPLATES, templates_for


@pytest.fixture(scope="module")
def train_set(tmp_path_factory) -> tuple[Path, list[Task]]:
    out = tmp_path_factory.mktemp("micro") / "train"
    return out, generate_micro(out, n=8, seed=0, split="train")


@pytest.fixture(scope="module")
def flaky_set(tmp_path_factory) -> list[Task]:
    return generate_micro(tmp_path_factory.mktemp("micro") / "flaky", n=4, seed=1, split="test", flaky_rate=1.0)


def pytest_run(repo: Path, *args: str, hash_seed: str = "0") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *args],
                          check=False, cwd=repo,
                          env=env, capture_output=True, text=True)


def working_copy(task: Task, dest: Path) -> Path:
    """A writable copy of the task's base checkout (the cached checkout itself stays pristine)."""
    shutil.copytree(base_checkout(task), dest)
    return dest


def git_apply(repo: Path, patch: str) -> None:
    subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, text=True, check=True, capture_output=True)


# ------------------------------------------------------------------------------------ bug families

@pytest.mark.parametrize("family, source, expected", [
    ("operator_swap", "def f(a, b):\n    return a + b\n", "return a - b"),
    ("off_by_one", "def f(a, b):\n    return a < b\n", "return a <= b"),
    ("wrong_variable", "def f(a, b):\n    return a * 2\n", "return b * 2"),
    ("negated_condition", "def f(a):\n    if a == 1:\n        return 2\n    return 3\n", "if a != 1:"),
    ("wrong_constant", "def f(a):\n    return a * 3  # triple\n", "return a * 4  # triple"),
    ("missing_branch", "def f(a):\n    if a < 0:\n        return 0\n    return a\n", "def f(a):\n    return a\n"),
    ("wrong_function", "def f(xs):\n    return max(xs)\n", "return min(xs)"),
    ("swapped_arguments", "def f(a, b):\n    return divmod(a, b)\n", "return divmod(b, a)"),
])
def test_each_bug_family_is_a_minimal_edit_that_keeps_comments(family, source, expected):
    (mutant,) = [m for m in mutants(source, family, random.Random(0)) if expected in m.source]
    assert mutant.function == "f" and mutant.family == family
    changed = [a for a, b in zip(source.splitlines(), mutant.source.splitlines()) if a != b]
    assert len(changed) <= 1 or family == "missing_branch"


def test_missing_branch_drops_one_elif_and_keeps_the_rest():
    source = ("def grade(s):\n    if s >= 90:\n        return 'A'\n    elif s >= 80:\n        return 'B'\n"
              "    elif s >= 70:\n        return 'C'\n    else:\n        return 'F'\n")
    texts = [m.source for m in mutants(source, "missing_branch", random.Random(0))]
    assert source.replace("    elif s >= 80:\n        return 'B'\n", "") in texts
    assert source.replace("    else:\n        return 'F'\n", "") in texts


def test_templates_are_split_disjointly_and_every_case_has_a_usable_expected_value(tmp_path):
    train, test = templates_for("train"), templates_for("test")
    assert len(train) >= 8 and len(test) >= 8
    assert not {t.name for t in train} & {t.name for t in test}
    for template in TEMPLATES:
        assert all(any(mutants(m.source, f, random.Random(0)) for m in template.modules) for f in
                   ("operator_swap", "wrong_variable", "negated_condition", "wrong_constant"))
        modules = [*template.modules, *FILLERS]
        repo = tmp_path / template.name
        for rel, text in _package_files("pkg", template, modules).items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        cases = [_Case(m.name, fn, args, False) for m in modules for fn, arg_list in m.cases.items()
                 for args in arg_list]
        reference = _probe(repo, "pkg", cases, [])["reference"]
        assert [(c.function, c.args, r) for c, r in zip(cases, reference) if "error" in r] == []
    for family in FAMILIES:  # every family can strike in both splits
        assert any(mutants(m.source, family, random.Random(0)) for t in train for m in t.modules)
        assert any(mutants(m.source, family, random.Random(0)) for t in test for m in t.modules)


# ------------------------------------------------------------------------------------ generation

def test_generation_is_deterministic_and_prefix_stable(train_set, tmp_path):
    out, _ = train_set
    again = tmp_path / "again"
    generate_micro(again, n=2, seed=0, split="train")
    first = (out / "tasks.jsonl").read_text().splitlines()
    assert (again / "tasks.jsonl").read_text().splitlines() == first[:2]  # byte for byte
    assert sorted(p.name for p in (again / "repos").iterdir()) == [f"micro-train-0-{i}.bundle" for i in range(2)]


def test_a_set_covers_bug_families_templates_and_records_its_metadata(train_set):
    out, tasks = train_set
    assert [t.instance_id for t in tasks] == [f"micro-train-0-{i}" for i in range(8)]
    assert len({t.metadata["bug_family"] for t in tasks}) >= 6
    train_names = {t.name for t in templates_for("train")}
    for t in tasks:
        m = t.metadata
        assert m["split"] == "train" and m["template"] in train_names and t.repo == f"micro/{m['template']}"
        assert m["difficulty"] in ("easy", "medium", "hard") and 3 <= m["n_modules"] <= 20
        assert m["flaky"] is None and m["buggy_file"].endswith(".py") and m["bug_family"] in FAMILIES
        assert t.FAIL_TO_PASS and not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert Path(t.repo_src) == (out / "repos" / f"{t.instance_id}.bundle").resolve()
    assert load_tasks(str(out)) == tasks


def test_the_bug_fails_the_fail_to_pass_tests_and_the_gold_patch_passes_all(train_set, tmp_path):
    _, tasks = train_set
    for task in tasks[:2]:
        repo = working_copy(task, tmp_path / task.instance_id)
        assert subprocess.run(["git", "rev-parse", "HEAD"], check=True, cwd=repo, capture_output=True, text=True
                              ).stdout.strip() == task.base_commit
        assert pytest_run(repo).returncode == 0  # the visible suite is green at base_commit
        git_apply(repo, task.test_patch)
        before = pytest_run(repo, *task.FAIL_TO_PASS)
        assert before.stdout.count("FAILED tests/") == len(task.FAIL_TO_PASS), before.stdout[-2000:]
        git_apply(repo, task.patch)
        # an unpinned run (another hash seed) also passes: tasks without a flaky label are deterministic
        after = pytest_run(repo, hash_seed="12345")
        assert after.returncode == 0, after.stdout[-2000:]
        assert all(f"PASSED {t}" in after.stdout for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
        # the issue describes a symptom, never the buggy line
        removed = [ln[1:].strip() for ln in task.patch.splitlines() if ln.startswith("-") and not ln.startswith("---")]
        assert all(line not in task.problem_statement for line in removed if line)
        assert task.metadata["package"] in task.problem_statement


# ------------------------------------------------------------------------------------ flaky tests

def flaky_task(tasks: list[Task], kind: str) -> Task:
    return next(t for t in tasks if t.metadata["flaky"]["kind"] == kind)


def run_test_function(repo: Path, test_id: str, hash_seed: str | None = None) -> bool:
    """Call one test function in a fresh interpreter: True if it passes."""
    file, name = test_id.split("::")
    code = (f"import sys; sys.path[:0] = ['.', 'tests']; import {Path(file).stem} as m; m.{name}()")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=repo, env=env, capture_output=True)
    return out.returncode == 0


def test_every_flaky_kind_is_planted_labelled_and_in_pass_to_pass(flaky_set):
    assert sorted(t.metadata["flaky"]["kind"] for t in flaky_set) == sorted(FLAKY_KINDS)
    test_names = {t.name for t in templates_for("test")}
    for t in flaky_set:
        assert t.metadata["flaky"]["test"] in t.PASS_TO_PASS and t.metadata["template"] in test_names


def test_hash_seed_and_random_flaky_tests_really_flake(flaky_set, tmp_path):
    task = flaky_task(flaky_set, "hash_seed")
    repo, test = working_copy(task, tmp_path / "hash"), task.metadata["flaky"]["test"]
    outcomes = {run_test_function(repo, test, hash_seed=str(s)) for s in range(8)}
    assert run_test_function(repo, test, hash_seed="0") and outcomes == {True, False}

    task = flaky_task(flaky_set, "random")
    repo, test = working_copy(task, tmp_path / "random"), task.metadata["flaky"]["test"]
    # unseeded random.random() >= 0.5 in fresh processes: all 16 alike has probability 2**-15
    assert {run_test_function(repo, test) for _ in range(16)} == {True, False}


def test_an_order_dependent_flaky_test_fails_when_run_after_its_neighbour(flaky_set, tmp_path):
    task = flaky_task(flaky_set, "test_order")
    repo, test = working_copy(task, tmp_path / "order"), task.metadata["flaky"]["test"]
    neighbour = test.replace("_starts_empty", "_records")
    assert f"PASSED {test}" in pytest_run(repo, test, neighbour).stdout
    assert f"FAILED {test}" in pytest_run(repo, neighbour, test).stdout


# ------------------------------------------------------------------------------------ CLI

def test_cli_generates_a_set_and_refuses_to_overwrite(train_set, tmp_path, monkeypatch):
    runner = CliRunner()
    out = tmp_path / "cli"
    monkeypatch.chdir(tmp_path)  # --out relative to the working directory, as a user types it
    result = runner.invoke(app, ["tasks", "micro", "--n", "1", "--seed", "0", "--split", "train", "--out", "cli"])
    assert result.exit_code == 0, result.output
    assert "1 micro tasks (train, seed 0)" in result.output and "tasks.jsonl" in result.output
    assert (out / "tasks.jsonl").read_text().splitlines() == (train_set[0] / "tasks.jsonl").read_text().splitlines()[:1]

    result = runner.invoke(app, ["tasks", "micro", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2 and "not an empty directory" in result.output
    assert (out / "tasks.jsonl").is_file()  # nothing already written is lost
    result = runner.invoke(app, ["tasks", "micro", "--n", "1", "--split", "dev", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown micro split" in result.output and not (tmp_path / "x").exists()

    result = runner.invoke(app, ["tasks", "show", str(train_set[0]), "--limit", "3"])
    assert result.exit_code == 0 and "micro-train-0-2" in result.output and "micro-train-0-3" not in result.output
