"""The eval script of a task row that carries none: what SWE-bench's harness runs to score it.

    lines = eval_script_lines(task)              # reset and patch the test files, run test_cmd on the ids
    lines = eval_script_lines(task, targets=test_directives(task))   # on the test patch's files instead

A property of the row, so it lives with the rows: the loaders bake it into old-schema SWE-bench rows
(crr.tasks.loaders.swebench_eval_script) and the verifier (crr.agent.verifier) runs it.

The runner cannot be swapped by the agent's files (issue 31): `python -m pytest` puts the working directory,
/testbed, first on sys.path, so a /testbed/pytest.py (or runpy.py, ...) written by the agent would run
instead of pytest and print whatever the log parser wants. `isolated_runner` starts pytest with the working
directory taken off the front of sys.path and appended at the end instead, as a .pth of an editable install
puts a repository: the tests still import the code under /testbed, but the runner, the standard library and
the installed packages resolve first. It is a `-c` program rather than `python -P` so that it holds on any
Python 3 (-P exists from 3.11). Byte-code caches are removed first: a __pycache__/*.pyc that matches a
source's mtime and size would run in place of that source, and model patches exclude caches.
"""

from __future__ import annotations

import random
import re
import shlex
from collections.abc import Sequence

from swebench.harness.constants import APPLY_PATCH_FAIL, END_TEST_OUTPUT, RESET_FAILED, START_TEST_OUTPUT
from swebench.utils import generate_heredoc_delimiter
from unidiff import PatchSet

from crr.tasks.schema import Task

# swebench 4.x NON_TEST_EXTS: files of a test patch that are data, not tests to run
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")


# `[VAR=value ...] python[3[.x]] -m pytest`: the runner form that puts the working directory first on sys.path
_PYTHON_M_PYTEST = re.compile(r"^((?:\w+=\S*\s+)*)(\S*python[\d.]*)\s+-m\s+pytest(?=\s|$)")
# `python -m pytest` without the working directory in front: sys is built in and os already loaded at startup,
# so nothing is looked up on the path before it is cleaned
_ISOLATED_PYTEST = ('import sys; sys.path[:] = [p for p in sys.path if p]; import os, runpy; '
                    'sys.path.append(os.getcwd()); runpy.run_module("pytest", run_name="__main__", alter_sys=True)')
PURGE_BYTECODE = "find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +"


def isolated_runner(test_cmd: str) -> str:
    """`test_cmd` with a `python -m pytest` runner replaced by one that files under the working directory
    cannot shadow (module doc); any other command unchanged (a console script such as `pytest` never puts
    the working directory on sys.path)."""
    return _PYTHON_M_PYTEST.sub(lambda m: f"{m[1]}{m[2]} -c {shlex.quote(_ISOLATED_PYTEST)}", test_cmd, count=1)


def seeded_order(tests: Sequence[str], seed: int) -> list[str]:
    """`tests` in the order a run with `seed` gives them to the runner: shuffled by seed // 2 and
    reversed for an odd seed. Seeds 2k and 2k + 1 thus see every two tests in both relative orders,
    so a pair of such runs exposes any dependence of one test's outcome on another's running first."""
    order = list(tests)
    random.Random(seed // 2).shuffle(order)
    return order[::-1] if seed % 2 else order


def test_directives(task: Task) -> list[str]:
    """What SWE-bench's harness gives the runner: the test files of the test patch (not data files),
    as dotted modules under tests/ for Django's runtests.py. Hand-written: swebench 5.x dropped its
    get_test_directives with the per-repo specs."""
    paths = [f.target_file[2:] for f in PatchSet(task.test_patch) if not f.is_removed_file]
    paths = [p for p in paths if not p.endswith(_NON_TEST_EXTS)]
    if task.repo == "django/django":
        paths = [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in paths]
    return paths


def eval_script_lines(task: Task, seed: int | None = None, targets: Sequence[str] | None = None) -> list[str]:
    """The swebench-style eval script (without shebang) for a task that carries none: reset the
    test-patch files, apply the test patch, drop byte-code caches, run test_cmd (`isolated_runner`) on
    `targets` (default: the held-out ids) between the markers (in `seeded_order(targets, seed)` when a seed
    is given)."""
    base = shlex.quote(task.base_commit)
    lines: list[str] = []
    if task.test_patch.strip():
        files = list(PatchSet(task.test_patch))
        existing = [shlex.quote(f.source_file[2:]) for f in files if not f.is_added_file]
        added = [shlex.quote(f.target_file[2:]) for f in files if f.is_added_file]
        if existing:
            lines.append(f"git checkout {base} -- {' '.join(existing)} "
                         f"|| {{ echo '{RESET_FAILED}'; exit 1; }}")
        if added:  # an agent that created them would make the apply fail
            lines.append(f"rm -rf -- {' '.join(added)}")
        patch = task.test_patch if task.test_patch.endswith("\n") else task.test_patch + "\n"
        delimiter = generate_heredoc_delimiter(patch)
        lines += [f"git apply --verbose - <<'{delimiter}'\n{patch}{delimiter}",
                  f"if [ $? -ne 0 ]; then echo '{APPLY_PATCH_FAIL}'; exit 1; fi"]
    # The ids go on the command line of the runner from this script file, so no argv-size limit of
    # the engine's exec applies; only the kernel's 2 MB, far above any task's id list.
    targets = task.held_out_tests if targets is None else targets
    tests = targets if seed is None else seeded_order(targets, seed)
    ids = " ".join(shlex.quote(t) for t in tests)
    lines += [PURGE_BYTECODE, f": '{START_TEST_OUTPUT}'", f"{isolated_runner(task.test_cmd)} {ids}".rstrip(),
              f": '{END_TEST_OUTPUT}'"]
    return lines
