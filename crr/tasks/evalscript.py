"""The eval script of a task row that carries none: what SWE-bench's harness runs to score it.

    lines = eval_script_lines(task)              # reset and patch the test files, run test_cmd on the ids
    lines = eval_script_lines(task, targets=test_directives(task))   # on the test patch's files instead

A property of the row, so it lives with the rows: the loaders bake it into old-schema SWE-bench rows
(crr.tasks.loaders.swebench_eval_script) and the verifier (crr.agent.verifier) runs it.
"""

from __future__ import annotations

import random
import shlex
from collections.abc import Sequence

from swebench.harness.constants import APPLY_PATCH_FAIL, END_TEST_OUTPUT, RESET_FAILED, START_TEST_OUTPUT
from swebench.utils import generate_heredoc_delimiter
from unidiff import PatchSet

from crr.tasks.schema import Task

# swebench 4.x NON_TEST_EXTS: files of a test patch that are data, not tests to run
_NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")


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
    test-patch files, apply the test patch, run test_cmd on `targets` (default: the held-out ids) between
    the markers (in `seeded_order(targets, seed)` when a seed is given)."""
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
    lines += [f": '{START_TEST_OUTPUT}'", f"{task.test_cmd} {ids}".rstrip(), f": '{END_TEST_OUTPUT}'"]
    return lines
