"""A tiny real SWE task for the tool and verifier tests: a module with a bug, a test patch that adds
the failing test, and the gold patch that fixes it."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from crr.tasks.schema import Task

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_FIXED = CALC.replace("a - b", "a + b")
TESTS = "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
TESTS_WITH_ADD = TESTS + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
F2P = ("tests/test_calc.py::test_add",)
P2P = ("tests/test_calc.py::test_mul",)


def file_diff(path: str, old: str | None, new: str) -> str:
    """A unified diff that `git apply` takes; old=None creates the file."""
    return "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        "/dev/null" if old is None else f"a/{path}", f"b/{path}"))


def calc_task(make_task: Callable[..., Task], **fields) -> Task:
    files = {"calc.py": CALC, "tests/test_calc.py": TESTS, "README.md": "calc\n"}
    return make_task(files, **{
        "instance_id": "calc-1", "repo": "local/calc",
        "problem_statement": "add() subtracts\nadd(2, 3) returns -1 instead of 5.",
        "patch": file_diff("calc.py", CALC, CALC_FIXED),
        "test_patch": file_diff("tests/test_calc.py", TESTS, TESTS_WITH_ADD),
        "FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P, "test_cmd": TEST_CMD, **fields})
