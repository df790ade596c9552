"""The nano tier: learnable tasks with procedural, split-disjoint names, built by the micro generator's path."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import subprocess

import pytest
from unidiff import PatchSet

from crr.errors import CRRError
from crr.tasks.loaders import TASKS_FILE, load_tasks
from crr.tasks import micro
from crr.tasks.micro import generate_micro
from crr.tasks.nano import SHAPES, nano_template


def _identifiers(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names - {"min", "max", "True", "False"}


def _template_names(split: str, seed: int) -> set[str]:
    t = nano_template(random.Random(seed), split)
    return {t.packages[0]} | {m.name for m in t.modules} | set().union(*(_identifiers(m.source) for m in t.modules))


def test_split_vocabularies_are_disjoint():
    train = set().union(*(_template_names("train", s) for s in range(300)))
    test = set().union(*(_template_names("test", s) for s in range(300)))
    assert len(train) > 2000 and len(test) > 2000  # large vocabularies: nothing recurs to memorise
    assert not train & test


def test_every_shape_documents_its_computation():
    t = nano_template(random.Random(3), "train")
    for module in t.modules:
        tree = ast.parse(module.source)
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
            doc = ast.get_docstring(fn)
            assert doc and doc.endswith(".") and len(fn.body) <= 6
    assert len(SHAPES) >= 10


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("nano")
    train = generate_micro(root / "train", n=6, seed=0, split="train", tier="nano")
    test = generate_micro(root / "test", n=6, seed=0, split="test", tier="nano", workers=2)
    return root, train, test


def test_rows_are_swebench_rows_with_measured_tests_and_one_line_fixes(sets):
    _, train, test = sets
    for task in train + test:
        assert task.instance_id.startswith("nano-") and task.metadata["tier"] == "nano"
        assert task.FAIL_TO_PASS and task.metadata["n_modules"] <= 4  # 1-3 modules and __init__.py
        (patched,) = PatchSet(task.patch)
        (hunk,) = list(patched)
        assert (hunk.removed, hunk.added) == (1, 1)
        module = task.metadata["buggy_file"][:-3].replace("/", ".")
        function = task.metadata["buggy_function"]
        # the issue names the failing call's module and function and states expected versus actual
        assert f"Calling `{module}.{function}(" in task.problem_statement
        assert "returns" in task.problem_statement or "raises" in task.problem_statement
        assert "I expected" in task.problem_statement
        assert len(task.problem_statement) < 300


def test_splits_share_no_identifier_and_no_instance(sets, tmp_path):
    _, train, test = sets

    def names(tasks):
        """Every identifier and module name of the instances' repositories at base_commit."""
        found = set()
        for task in tasks:
            clone = tmp_path / task.instance_id
            subprocess.run(["git", "clone", "-q", task.repo_src, str(clone)], check=True, capture_output=True)
            for path in clone.rglob("*.py"):
                found |= _identifiers(path.read_text()) | {path.stem}
        return found - {"pytest", "__init__", "__version__", "approx", "raises"}

    shared = names(train) & names(test)
    assert not shared
    assert not {t.patch for t in train} & {t.patch for t in test}
    assert not {t.problem_statement for t in train} & {t.problem_statement for t in test}


def test_the_generators_first_templates_of_30_plus_30_instances_share_no_identifier():
    """The templates generate_micro's first attempts build (its rng seeds), 30 instances per split."""

    def names(split):
        found = set()
        for index in range(30):
            t = nano_template(random.Random(f"nano:0:{split}:{index}:0"), split)
            found |= {t.packages[0]} | {m.name for m in t.modules}
            found |= set().union(*(_identifiers(m.source) for m in t.modules))
        return found

    assert not names("train") & names("test")


def test_the_default_tier_plans_the_pre_nano_tasks():
    """Bug family, size and template order of default-tier tasks, pinned to the generator before the nano tier
    (commit 6e19661; an extra "nano" size once crept into the default tier's size cycle and changed every row)."""
    plan = [[f, s, [t.name for t in ts]] for split in ("train", "test")
            for f, s, ts in (micro._choices(i, 0, split) for i in range(12))]
    assert {s for _, s, _ in plan} == {"small", "medium", "large"}
    digest = hashlib.sha256(json.dumps(plan).encode()).hexdigest()
    assert digest == "ca3e9332ee865cdb7a01c69d574dfee8a425f856d005549d0157138ce61eba56"


def test_same_rows_whatever_the_workers_and_with_fresh_or_warm_pytest(sets, tmp_path):
    """The fixture's test set ran 2 workers and the warm pytest worker (forks of one interpreter, lean: built-in
    plugins nano tests never reach turned off); one process running a fresh `python -m pytest` with every plugin
    on per measurement gives the same rows byte for byte."""
    root, train, test = sets
    again = generate_micro(tmp_path / "again", n=3, seed=0, split="test", tier="nano", warm=False)
    first = [json.loads(line) for line in (root / "test" / TASKS_FILE).read_text().splitlines()][:3]
    assert [json.loads(line) for line in (tmp_path / "again" / TASKS_FILE).read_text().splitlines()] == first
    assert [t.base_commit for t in again] == [t.base_commit for t in test[:3]]
    assert load_tasks(str(root / "train"))[0].problem_statement == train[0].problem_statement


def test_bad_tier_is_a_clear_error(tmp_path):
    with pytest.raises(CRRError, match="unknown micro tier 'pico'"):
        generate_micro(tmp_path / "x", n=1, seed=0, split="train", tier="pico")
