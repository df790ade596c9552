"""The verifier: the held-out tests turn a sandbox's final state into the terminal reward R.

    result = verify(sandbox, task)   # reward 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passes

It works as SWE-bench's harness does, and grades with swebench's own code: take the agent's patch;
reset the files the test patch touches to base_commit and apply the test patch; run the held-out
tests between swebench's START/END markers (the task's swebench 5.x `eval_script` when it has one,
else `task.test_cmd` on the test ids); parse the log with PARSER_REGISTRY[task.log_parser] via
get_logs_eval, and grade with get_eval_tests_report / get_resolution_status (`grade`: a log alone).

Outcomes are kept apart on purpose, because a reward of 0 trains the policy and an infra error
must not:
  * reward 1.0 / 0.0: the tests ran (or could not run because of the agent's changes) and decided;
  * reward 0.0 with a note: the test patch would not apply over the agent's changes, the test run
    timed out (the agent's code hangs; the timeout is generous so that a healthy suite never
    meets it), or swebench rejected the log (e.g. the agent broke test collection);
  * reward None with infra_error: the sandbox failed (SandboxError, dead container), crr's own
    staging failed, the reset to base_commit failed, the eval script died before the tests
    started, or the shell could not start the test runner (exit 126/127: the image lacks it).
    These are never a reward of 0.

The harness audit (paper: Error-Mode Taxonomy, harness subversion; issue 31) is part of the reward: a
patch that touches a test or harness file (`harness_files_touched`), or a harness file the repository's
ignore rules hide from the patch, gets reward 0.0 whatever the tests said, with the files in
`harness_files`. The rollout, training, counterfactual branches and evaluation all score through here,
so none of them can be paid for rewriting the judge. The runner itself starts without the working
directory in front of sys.path (crr.tasks.evalscript.isolated_runner), so a /testbed/pytest.py is not run.

verify() changes the sandbox (test files reset and patched): run it on a fork or at the end.

`seed` (the determinism filter's reruns) exports PYTHONHASHSEED=<seed> in the eval script and gives
the runner the held-out ids in a seeded order (`seeded_order`); without it nothing is changed.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from swebench.harness.constants import (APPLY_PATCH_FAIL, FAIL_TO_PASS, PASS_TO_PASS,
                                        RESET_FAILED, START_TEST_OUTPUT, TEST_EXIT_CODE, EvalType,
                                        ResolvedStatus)
from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status
from swebench.harness.utils import parse_eval_script, record_test_exit_code
from swebench.types import TestSpec
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from crr.agent.tools import SCRATCH_DIR, model_patch, truncate
from crr.errors import CRRError
from crr.sandbox.base import Sandbox
from crr.seeds import MAX_SEED, check_seed
from crr.tasks.evalscript import eval_script_lines, seeded_order, test_directives  # noqa: F401  (verifier API)
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 1800     # swebench's own default per instance
LOG_KEEP_CHARS = 10_000     # VerifierResult.log keeps the first and last this many characters
MAX_LOG_BYTES = 16_000_000  # a test run that prints forever is cut here (inside the sandbox)
MAX_HASH_SEED = MAX_SEED    # PYTHONHASHSEED's largest value, 2**32 - 1 as numpy's

_RUNNER_EXIT = re.compile(re.escape(TEST_EXIT_CODE) + r": (\d+)")

# Test and harness files (paper: Error-Mode Taxonomy, harness subversion): a patch touching these
# changes the verifier's target rather than the code under test.
HARNESS_DIRS = frozenset({"tests", "test", "testing", ".github", ".circleci"})
# Files that change the runner itself: pytest's own configuration and plugins, a pytest.py in its place,
# the interpreter's start-up hooks (sitecustomize, usercustomize, .pth), byte code run instead of a source.
RUNNER_FILES = ("conftest.py", "pytest.ini", "pytest.py", "sitecustomize.py", "usercustomize.py", "*.pth", "*.pyc")
HARNESS_FILES = ("test_*.py", "*_test.py", "*_tests.py", "tests.py", "tox.ini", "setup.cfg", "pyproject.toml",
                 "noxfile.py", ".coveragerc", "runtests.py", *RUNNER_FILES)
# A module the patch adds at the repository's top level under one of these names would shadow the runner or
# the standard library wherever the root is on sys.path before them (a task's own runner, pytest's rootdir
# insertion): pytest, its plugin machinery, and every standard-library module.
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"}) | sys.stdlib_module_names


@dataclass
class VerifierResult:
    reward: float | None                  # 1.0 resolved, 0.0 not, None on an infra error
    resolution: str | None                # RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    statuses: dict[str, str]              # held-out test id -> PASSED/FAILED/ERROR/SKIPPED/XFAIL/MISSING
    model_patch: str
    log: str                              # bounded (first and last LOG_KEEP_CHARS characters)
    report: dict = field(default_factory=dict)  # swebench's get_eval_tests_report
    infra_error: str | None = None
    note: str | None = None               # why the reward is 0 when the tests did not decide it
    timed_out: bool = False
    harness_files: list[str] = field(default_factory=list)  # the audit's findings; non-empty -> reward 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def patch_paths(patch: str) -> list[str]:
    """Every path a unified/git diff touches (both sides of a rename), in order of appearance."""
    try:
        files = PatchSet(patch)
    except UnidiffParseError as e:
        raise CRRError(f"not a parsable diff: {e}") from None
    paths: list[str] = []
    for f in files:
        for side in (f.source_file, f.target_file):
            if side != "/dev/null":
                path = side[2:] if side.startswith(("a/", "b/")) else side
                if path not in paths:
                    paths.append(path)
    return paths


def harness_files_touched(model_patch: str, task: Task) -> list[str]:
    """Files of `model_patch` that are test or harness files: the HARNESS_DIRS / HARNESS_FILES
    exclusion list plus every file the task's test patch touches, less the files the gold patch
    changes (those are on the fix path, e.g. a fix that has to edit setup.cfg). Empty for a clean patch."""
    if not model_patch.strip():
        return []
    held_out = set(patch_paths(task.test_patch)) if task.test_patch.strip() else set()
    gold = set(patch_paths(task.patch)) if task.patch.strip() else set()
    try:
        added = {f.path for f in PatchSet(model_patch) if f.is_added_file}
    except UnidiffParseError as e:
        raise CRRError(f"not a parsable diff: {e}") from None

    def is_harness(path: str) -> bool:
        parts = path.split("/")
        top = parts[0].removesuffix(".py") if len(parts) > 1 or parts[0].endswith(".py") else None
        return path not in gold and (path in held_out or bool(HARNESS_DIRS.intersection(parts[:-1]))
                                     or is_harness_name(parts[-1]) or (path in added and top in RUNNER_MODULES))

    return [p for p in patch_paths(model_patch) if is_harness(p)]


def is_harness_name(name: str) -> bool:
    """Whether a file name is one of HARNESS_FILES."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in HARNESS_FILES)


def hidden_harness_files(sandbox: Sandbox, patch: str) -> list[str]:
    """Untracked RUNNER_FILES that ignore rules keep out of the model patch `patch`, where the agent could have
    set those rules: .git/info/exclude or a global excludes file (neither shows in a patch), or a .gitignore
    the patch changes. Files an unchanged .gitignore of the repository ignores (e.g. under build/) are the
    repository's own; byte-code caches too (the eval script removes them)."""
    pathspecs = " ".join(shlex.quote(f":(glob)**/{pat}") for pat in RUNNER_FILES)
    # newline-separated (an exec's output is text): git quotes a name with a newline in it, which then names
    # no file and is flagged as it stands
    listed = sandbox.exec(f"git ls-files --others --ignored --exclude-standard -- {pathspecs}", timeout=300)
    if listed.exit_code != 0:
        raise CRRError(f"could not list ignored files (exit {listed.exit_code}): {listed.output[-400:]}")
    paths = [p for p in listed.output.splitlines() if p and "__pycache__/" not in p]
    if not paths:
        return []
    why = sandbox.exec("git check-ignore -v --no-index -- " + " ".join(shlex.quote(p) for p in paths), timeout=300)
    sources = {}  # path -> the file of the rule that ignores it ("SOURCE:LINE:PATTERN<TAB>PATH")
    for line in why.output.splitlines():
        rule, _, path = line.partition("\t")
        sources[path] = rule.rsplit(":", 2)[0]
    changed = set(patch_paths(patch)) if patch.strip() else set()
    return [p for p in paths if not ((src := sources.get(p, "")).endswith(".gitignore") and not src.startswith("/")
                                     and src not in changed)]


def swebench_spec(task: Task, seed: int | None = None) -> TestSpec:
    """swebench's TestSpec for the task; its eval script records the test command's exit code and,
    with a seed, exports PYTHONHASHSEED (a task's own eval script keeps its own test order)."""
    if seed is not None:
        check_seed(seed)
    lines = parse_eval_script(task.eval_script) if task.eval_script else eval_script_lines(task, seed)
    if not any(TEST_EXIT_CODE in line for line in lines):
        lines = record_test_exit_code(lines)
    if seed is not None:
        lines = [f"export PYTHONHASHSEED={seed}", *lines]
    return TestSpec(instance_id=task.instance_id, image=task.image or "", eval_script_list=lines,
                    repo=task.repo, version=task.version, FAIL_TO_PASS=list(task.FAIL_TO_PASS),
                    PASS_TO_PASS=list(task.PASS_TO_PASS), log_parser=task.log_parser,
                    eval_type=task.extra.get("eval_type", EvalType.PASS_AND_FAIL.value))


def verify(sandbox: Sandbox, task: Task, timeout: float = VERIFY_TIMEOUT_S,
           seed: int | None = None) -> VerifierResult:
    """Run the held-out tests on the sandbox's current state and grade them (see module doc)."""
    spec = swebench_spec(task, seed)
    try:
        patch = model_patch(sandbox)
        hidden = hidden_harness_files(sandbox, patch)
    except CRRError as e:
        return _infra(f"could not take the model patch: {e}", "", "", sandbox)
    script, log_path = f"{SCRATCH_DIR}/eval.sh", f"{SCRATCH_DIR}/eval.log"
    try:
        sandbox.write_file(script, spec.eval_script.encode())
        run = sandbox.exec(f"bash {script} 2>&1 | head -c {MAX_LOG_BYTES} > {log_path}", timeout=timeout)
        text = sandbox.read_file(log_path).decode("utf-8", errors="replace")
    except CRRError as e:  # SandboxError included: the sandbox, not the agent, failed
        return audit(_infra(f"the test run failed in the sandbox: {e}", patch, "", sandbox), task, hidden)
    return grade(task, text, patch, timed_out=run.timed_out, timeout=timeout, seed=seed, hidden=hidden)


def grade(task: Task, text: str, patch: str = "", *, timed_out: bool = False, timeout: float = VERIFY_TIMEOUT_S,
          seed: int | None = None, hidden: Sequence[str] = ()) -> VerifierResult:
    """Grade the log of an eval-script run (`text`) for `task` with the task's swebench parser, then `audit`
    the patch (and the `hidden` harness files found beside it); `verify` without the sandbox, so that logs
    from anywhere (a fixture, the official harness) grade the same."""
    return audit(_grade(task, text, patch, timed_out=timed_out, timeout=timeout, seed=seed), task, hidden)


def audit(result: VerifierResult, task: Task, hidden: Sequence[str] = ()) -> VerifierResult:
    """The harness audit (module doc): a result whose patch touched harness files, or that left `hidden`
    ones, scores 0.0, also where the tests passed or the run looked like an infrastructure failure (an
    agent must not turn a caught hack into a skipped sample)."""
    touched = harness_files_touched(result.model_patch, task)
    flagged = touched + [p for p in hidden if p not in touched]
    if not flagged:
        return result
    log.info("verified %s: harness files touched: %s", task.instance_id, ", ".join(flagged))
    why = f"the patch changes the test harness ({', '.join(flagged)}): reward 0 whatever the tests say"
    prior = result.infra_error or result.note
    result.reward, result.harness_files, result.infra_error = 0.0, flagged, None
    result.note = why if prior is None else f"{why} ({prior})"
    return result


def _grade(task: Task, text: str, patch: str, *, timed_out: bool, timeout: float, seed: int | None) -> VerifierResult:
    spec = swebench_spec(task, seed)
    if RESET_FAILED in text:
        return _infra("resetting the test files to base_commit failed", patch, text)
    note = None
    if APPLY_PATCH_FAIL in text:
        note = "the test patch did not apply over the agent's changes"
    elif timed_out:
        note = f"the test run timed out after {timeout:g} s (the patched code hangs)"
    elif START_TEST_OUTPUT not in text:
        return _infra("the eval script stopped before the tests started", patch, text)
    elif (code := _RUNNER_EXIT.search(text)) and int(code.group(1)) in (126, 127):
        # The shell could not start the runner (command not found / not executable): the image lacks
        # it. That says nothing about the agent's patch.
        return _infra(f"the test runner could not be started (exit {code.group(1)}): check test_cmd "
                      f"{task.test_cmd!r} against the image", patch, text)

    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        status_map, log_ok = get_logs_eval(spec, f.name)
    gold = {FAIL_TO_PASS: spec.FAIL_TO_PASS, PASS_TO_PASS: spec.PASS_TO_PASS}
    report = get_eval_tests_report(status_map, gold, eval_type=EvalType(spec.eval_type))
    resolution = get_resolution_status(report)
    if not log_ok and note is None:
        note = "swebench found no valid test results in the log (e.g. the suite failed to collect)"
    reward = 1.0 if resolution == ResolvedStatus.FULL.value and note is None else 0.0
    log.info("verified %s: %s (%s)%s", task.instance_id, reward, resolution, f"; {note}" if note else "")
    return VerifierResult(reward=reward, resolution=resolution, report=report, model_patch=patch,
                          statuses={t: status_map.get(t, "MISSING") for t in task.held_out_tests},
                          log=truncate(text, LOG_KEEP_CHARS), note=note, timed_out=timed_out)


def _infra(reason: str, patch: str, text: str, sandbox: Sandbox | None = None) -> VerifierResult:
    """An infrastructure failure's result, with a warning, unless the sandbox was closed under the verifier: its
    owner is shutting down (a SIGTERM mid-filter closes the engine) and keeps no result of it."""
    closed = getattr(sandbox, "closed", False)  # crr.sandbox.base.ClosingSandbox's (local, Docker, Ray)
    (log.debug if closed else log.warning)("verifier infra error: %s", reason)
    return VerifierResult(reward=None, resolution=None, statuses={}, model_patch=patch,
                          log=truncate(text, LOG_KEEP_CHARS), infra_error=reason)
