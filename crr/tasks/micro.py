"""The embedded micro task set: procedurally generated SWE tasks that run anywhere in seconds.

Each task is a small Python package (a template from crr.tasks.templates plus generic filler
modules, 3 to 20 modules), with exactly one bug injected by an AST transform (crr.tasks.bugs), an
issue text written from the bug's observable symptom, a gold patch, and a test patch adding held-out
tests. FAIL_TO_PASS and PASS_TO_PASS are not predicted but measured: pytest runs before and after
the gold patch (test patch applied) in a throw-away clone, and swebench's pytest log parser reads
the results, exactly as the evaluation will.

Determinism: every random choice comes from a `random.Random` keyed by (seed, split, index, attempt)
(crr.seeds.keyed_random), git identities and dates are fixed, and the measuring pytest runs pin
all nondeterminism (PYTHONHASHSEED=0, file order, and a plugin that seeds `random` and freezes
`time.time_ns` around each test). So the same (n, seed, split, flaky_rate) gives the same rows byte
for byte. A candidate whose bug is not revealed, or whose gold patch leaves a test failing, is
replaced by the next attempt for the same index.

Tiers: "default" (the templates of crr.tasks.templates with filler modules and look-alike decoys, 3 to 20
modules) and "nano" (crr.tasks.nano: 1-3 short procedurally named modules whose docstrings state what the
code must do, no fillers or decoys, a one-sentence issue; the learnable tier of the CPU testbed). Both take
the same path from a template to a row; "multi" (crr.tasks.multi: nano packages with 1-3 bugs, symptom-only
issues and look-alike modules) reuses its pieces. Nano and multi also have a "val" split: the test split's
vocabulary, instances of their own.

Flaky tests (`flaky_rate`): a seed-chosen fraction of tasks get one labelled flaky test among
PASS_TO_PASS that depends on the hash seed, the test order, unseeded randomness or the clock. The
pinned measuring runs force its passing branch; unpinned runs (the determinism filter's reruns)
make it flake. `metadata["flaky"]` records {"kind", "test"} as ground truth for the filter.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from crr.errors import CRRError
from crr.sandbox.checkout import building
from crr.seeds import keyed_random
from crr.tasks.bugs import FAMILIES, Mutant, iter_mutants, mutants
from crr.tasks.multi import (
    ISSUE_STYLES,
    MAX_CORE_MODULES,
    RUN_TESTS_CMD,
    SITES_PER_BUG,
    Knobs,
    Symptom,
    multi_issue,
    multi_template,
)
from crr.tasks.nano import NANO_FAMILIES, nano_template
from crr.tasks.schema import (
    DEFAULT_LOG_PARSER,
    DEFAULT_TEST_CMD,
    TASKS_FILE,
    Task,
    read_tasks_jsonl,
    write_tasks,
)
from crr.tasks.templates import FILLERS, TEMPLATES, Module, Template, templates_for
from crr.tasks.warm import WarmPytest

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")   # "val": the nano and multi tiers only (the default tier's templates are two pools)
TIERS = ("default", "nano", "multi")
FLAKY_KINDS = ("hash_seed", "test_order", "random", "time")
MAX_ATTEMPTS = 24         # candidates tried per task before giving up
MAX_PROBED_MUTANTS = 8    # mutation sites evaluated per candidate
PYTEST_TIMEOUT_S = 120
# Package size per tier: (modules, decoy functions) ranges. Tiers cycle like bug families, so a set
# spans sizes; the difficulty label is still computed from what the task ends up with.
SIZES = {"small": ((3, 6), (0, 1)), "medium": ((6, 12), (1, 2)), "large": ((12, 20), (2, 3))}
# nano: the template's own modules only. Not in SIZES: the default tier cycles through SIZES (a fourth entry there
# changed every default row and let default tasks draw the nano size).
_NANO_SIZE = ((0, 0), (0, 0))

# Fixed identity and dates (and no user or system git config) make base_commit a function of content.
_GIT_ENV = {"GIT_AUTHOR_NAME": "crr micro", "GIT_AUTHOR_EMAIL": "micro@crr.invalid",
            "GIT_COMMITTER_NAME": "crr micro", "GIT_COMMITTER_EMAIL": "micro@crr.invalid",
            "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

# Loaded into the measuring pytest runs only (never part of a task's repository).
_PIN_PLUGIN = '''\
"""Pin the nondeterminism a micro test can touch, so F2P/P2P measurement is reproducible."""
import random
import time

import pytest

FROZEN_NS = 1_700_000_000_000_000_000  # an even microsecond


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    random.seed(0)
    real = time.time_ns
    time.time_ns = lambda: FROZEN_NS
    try:
        yield
    finally:
        time.time_ns = real
'''
_PIN_MODULE = "crr_micro_pin"


@dataclass(frozen=True)
class _Case:
    module: str
    function: str
    args: str      # Python source of the call's arguments
    core: bool     # a template module (bugs live there), not a filler


@dataclass
class _TestFile:
    module: str
    header: list[str] = field(default_factory=list)   # import lines
    visible: list[str] = field(default_factory=list)  # test function sources at base_commit
    held_out: list[str] = field(default_factory=list)  # added by the test patch


def check_micro_args(n: int, split: str, flaky_rate: float = 0.0, tier: str = "default", workers: int = 1,
                     first: int = 0, knobs: Knobs | None = None) -> None:
    """generate_micro's arguments: a CRRError for the first bad one (a caller checks them before making anything)."""
    if split not in SPLITS:
        raise CRRError(f"unknown micro split {split!r}; use one of {', '.join(SPLITS)}")
    if tier not in TIERS:
        raise CRRError(f"unknown micro tier {tier!r}; use one of {', '.join(TIERS)}")
    if split == "val" and tier == "default":
        raise CRRError("the default tier has train and test splits only; --split val is for --tier nano or multi")
    if tier == "multi" and flaky_rate > 0:
        raise CRRError("the multi tier plants no flaky tests; drop --flaky-rate")
    if knobs is not None and tier != "multi":
        raise CRRError(f"--bugs/--issue/--distractors are the multi tier's knobs, not the {tier} tier's")
    if workers < 1:
        raise CRRError(f"--workers must be at least 1, got {workers}")
    if first < 0 or (first > 0 and flaky_rate > 0):
        raise CRRError("--first must be >= 0, and 0 with --flaky-rate (the flaky plan spans the whole set)")
    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    if not 0.0 <= flaky_rate <= 1.0:
        raise CRRError(f"--flaky-rate must be between 0 and 1, got {flaky_rate}")


def generate_micro(out_dir: Path | str, n: int, seed: int, split: str, flaky_rate: float = 0.0,
                   progress: Callable[[Task], None] | None = None, tier: str = "default",
                   workers: int = 1, first: int = 0, warm: bool = True, knobs: Knobs | None = None) -> list[Task]:
    """Generate `n` tasks into `out_dir` (tasks.jsonl + repos/<id>.bundle) and return them.

    `out_dir` must not exist or be empty; it is filled atomically (built next to it, then renamed).
    Task i depends only on (tier, seed, split, i) and its flaky kind, so with flaky_rate 0 a larger n
    extends a smaller one, `first` > 0 generates tasks first..first+n-1 of that same sequence (a large
    set in chunks), and `workers` processes give the same rows as one. `warm` runs pytest in forks of a
    warm worker (crr.tasks.warm) rather than a fresh interpreter each time: same outcomes, less time.
    `knobs` (the multi tier only; default Knobs()) set its bug counts, issue styles and distractors.
    """
    check_micro_args(n, split, flaky_rate, tier, workers, first, knobs)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CRRError(f"{out_dir} already exists and is not an empty directory; choose a new --out "
                       "(nothing was written)")
    scratch = Path(tempfile.mkdtemp(prefix="crr-micro-", dir=_scratch_root()))
    try:
        with building(out_dir.absolute(), keep_theirs=lambda _: False) as build:
            build.mkdir()
            (scratch / f"{_PIN_MODULE}.py").write_text(_PIN_PLUGIN)
            flaky = _flaky_plan(n, seed, split, flaky_rate)
            jobs = [(index, seed, split, flaky.get(index), build, scratch, tier, warm, knobs)
                    for index in range(first, first + n)]
            tasks = []
            # Processes, not threads: a candidate is mostly Python (AST mutants, git and pytest plumbing).
            with (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1
                  else contextlib.nullcontext()) as pool:
                for task in (pool.map(_generate_job, jobs) if pool else map(_generate_job, jobs)):
                    tasks.append(task)
                    if progress is not None:
                        progress(task)
            write_tasks(tasks, build / TASKS_FILE)
    finally:
        _close_warm()
        shutil.rmtree(scratch, ignore_errors=True)
    return read_tasks_jsonl(out_dir / TASKS_FILE)  # what is on disk, with repo_src inside out_dir


def _scratch_root() -> str | None:
    """Where candidates' throw-away repositories go: /dev/shm when it is a tmpfs with room (each candidate
    writes, commits, tests and removes a repository with its .git in a few hundred ms; on a disk the removal
    alone costs tens of ms), else the default temporary directory. Rows do not depend on the location."""
    try:
        st = os.statvfs("/dev/shm")
        if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize >= 1 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------ planning

def _flaky_plan(n: int, seed: int, split: str, rate: float) -> dict[int, str]:
    """index -> flaky kind for round(rate * n) seed-chosen tasks, kinds in a seed-shuffled cycle."""
    rng = keyed_random("micro", seed, split, n, "flaky")
    chosen = sorted(rng.sample(range(n), round(rate * n)))
    kinds = list(FLAKY_KINDS)
    rng.shuffle(kinds)
    return {index: kinds[i % len(kinds)] for i, index in enumerate(chosen)}


@functools.cache
def _has_sites(template_name: str, family: str) -> bool:
    template = next(t for t in TEMPLATES if t.name == template_name)
    return any(next(iter_mutants(m.source, family, random.Random(0)), None) for m in template.modules)


def _choices(index: int, seed: int, split: str) -> tuple[str, str, list[Template]]:
    """The task's bug family and size (seed-shuffled cycles, so every family and size appears) and
    its templates in the order attempts try them (a rotated seed-shuffled cycle, for balance)."""
    rng = keyed_random("micro", seed, split, "order")
    families, sizes, pool = list(FAMILIES), list(SIZES), list(templates_for(split))
    for order in (families, sizes, pool):
        rng.shuffle(order)
    family = families[index % len(families)]
    rotated = [pool[(index + k) % len(pool)] for k in range(len(pool))]
    return family, sizes[index % len(sizes)], [t for t in rotated if _has_sites(t.name, family)]


def _generate_job(job: tuple) -> Task:
    *args, knobs = job
    if args[6] == "multi":
        index, seed, split, _, out, scratch, _, warm = args
        return _multi_task(index, seed, split, knobs or Knobs(), out, scratch, warm)
    return _generate_task(*args)


def _generate_task(index: int, seed: int, split: str, flaky: str | None, out: Path, scratch: Path,
                   tier: str = "default", warm: bool = False) -> Task:
    if tier == "nano":
        family = _nano_family(index, seed, split)
        instance_id = f"nano-{split}-{seed}-{index}"
    else:
        family, size, templates = _choices(index, seed, split)
        instance_id = f"micro-{split}-{seed}-{index}"
    for attempt in range(MAX_ATTEMPTS):
        prefix = "micro" if tier == "default" else tier
        rng = keyed_random(prefix, seed, split, index, attempt)
        work = scratch / f"{instance_id}-{attempt}"
        if tier == "nano":
            template, size = nano_template(rng, split), "nano"
        else:
            template = templates[attempt % len(templates)]
        try:
            task = _candidate(instance_id, template, family, size, flaky, split, rng, work, out, warm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if task is not None:
            return task
        log.debug("%s: attempt %d rejected", instance_id, attempt)
    raise CRRError(f"could not generate {instance_id} in {MAX_ATTEMPTS} attempts; this is a bug in crr's "
                   "micro generator, please report the seed and split")


# ------------------------------------------------------------------------------------ one candidate

def _nano_family(index: int, seed: int, split: str) -> str:
    """The nano bug families in a seed-shuffled cycle, so every family appears."""
    families = list(NANO_FAMILIES)
    keyed_random("nano", seed, split, "order").shuffle(families)
    return families[index % len(families)]


def _candidate(instance_id: str, template: Template, family: str, size: str, flaky: str | None, split: str,
               rng: random.Random, work: Path, out: Path, warm: bool = False) -> Task | None:
    package = rng.choice(template.packages)
    (low, high), (fewest, most) = _NANO_SIZE if size == "nano" else SIZES[size]
    n_decoys = rng.randint(fewest, most)
    target = rng.randint(low, high)
    base_count = len(template.modules) + 1 + (n_decoys > 0)  # template modules, __init__, legacy
    fillers = rng.sample(FILLERS, min(len(FILLERS), max(0, target - base_count)))
    modules = [*template.modules, *fillers]
    cases = [_Case(m.name, fn, args, m in template.modules)
             for m in modules for fn, arg_list in m.cases.items() for args in arg_list]

    # 1. Expected values and candidate bugs, evaluated in a fresh process.
    repo = work / "repo"
    files = _package_files(package, template, modules)
    _write(repo, files)
    sites = [(m, mu) for m in template.modules for mu in mutants(m.source, family, rng)]
    rng.shuffle(sites)
    sites = sites[:MAX_PROBED_MUTANTS]
    probe = _probe(repo, package, cases, sites)
    reference = probe["reference"]
    unusable = [i for i, r in enumerate(reference) if "error" in r]
    if unusable:
        log.warning("%s: template %s has unusable cases %s", instance_id, template.name,
                    [(cases[i].function, reference[i]["error"]) for i in unusable])
    chosen = next(((m, mu, res) for (m, mu), res in zip(sites, probe["mutants"])
                   if res["revealing"] and not res["timeout"]), None)
    if chosen is None:
        return None
    bug_module, bug, result = chosen
    log.debug("%s: %s bug in %s.%s line %d (%s)", instance_id, family, bug_module.name, bug.function, bug.lineno,
              bug.description)
    revealing = set(result["revealing"]) - set(unusable)
    if not revealing:
        return None

    # 2. Held-out tests: every revealing case plus a few passing ones of the same functions.
    bug_functions = {cases[i].function for i in revealing}
    passing_peers = [i for i, c in enumerate(cases) if c.function in bug_functions and i not in revealing
                     and i not in unusable]
    held_out = revealing | set(rng.sample(passing_peers, min(2, len(passing_peers))))

    # 3. The repository at base_commit: the bug, decoys, visible tests, maybe a flaky test.
    files[f"{package}/{bug_module.name}.py"] = bug.source
    decoys = _decoy_functions(template, bug, bug_module, n_decoys, rng)
    if decoys:
        legacy = rng.choice(("legacy", "compat"))
        files[f"{package}/{legacy}.py"] = _legacy_module(package, bug_module, bug, decoys)
    tests, test_ids = _test_files(package, cases, reference, held_out, unusable)
    flaky_test = _plant_flaky(flaky, tests, template, rng) if flaky else None
    base_commit = _initial_commit(repo, package, files, tests)

    # 4. Test patch and gold patch as real git diffs against base_commit.
    test_patch = files_diff(repo, {f"tests/test_{t.module}.py": _render(t, held_out=True)
                              for t in tests.values() if t.held_out})
    patch = files_diff(repo, {f"{package}/{bug_module.name}.py": bug_module.source})

    # 5. Measure FAIL_TO_PASS / PASS_TO_PASS.
    pinned_git(repo, "apply", "-", stdin=test_patch)
    lean = warm and size == "nano"
    before = _pytest(repo, work.parent, warm, lean)
    pinned_git(repo, "apply", "-", stdin=patch)
    after = _pytest(repo, work.parent, warm, lean)
    if not after or any(status != "PASSED" for status in after.values()):
        return None  # the gold patch must pass everything
    f2p = [t for t in after if before.get(t) != "PASSED"]
    p2p = [t for t in after if before.get(t) == "PASSED"]
    held_ids = {test_ids[i] for i in held_out}
    if not f2p or not set(f2p) <= held_ids or (flaky_test and flaky_test not in p2p):
        return None

    # 6. The issue text, from one measured failing test.
    case_of = {tid: i for i, tid in test_ids.items()}
    symptoms = sorted((i for i in (case_of[t] for t in f2p) if str(i) in result["observed"]),
                      key=lambda i: (len(cases[i].args) + len(result["observed"][str(i)]), i))
    if not symptoms:
        return None
    shown = rng.choice(symptoms[:3])
    problem = issue_text(rng, package, template, cases[shown], reference[shown], result["observed"][str(shown)],
                     short=size == "nano")

    bundle = out / "repos" / f"{instance_id}.bundle"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    pinned_git(repo, "bundle", "create", "-q", str(bundle), "HEAD", "main")

    n_modules = sum(1 for path in files if path.startswith(f"{package}/"))
    indirect = bug.function not in bug_functions
    metadata = {
        "split": split, "template": template.name, "bug_family": family,
        "difficulty": _difficulty(n_modules, len(decoys), family, indirect),
        "n_modules": n_modules, "n_decoys": len(decoys), "package": package,
        "buggy_file": f"{package}/{bug_module.name}.py", "buggy_function": bug.function,
        "flaky": {"kind": flaky, "test": flaky_test} if flaky else None,
    }
    if size == "nano":
        metadata["tier"] = "nano"
    return Task(instance_id=instance_id, repo="crr/nano" if size == "nano" else f"micro/{template.name}",
                base_commit=base_commit,
                problem_statement=problem, patch=patch, test_patch=test_patch,
                FAIL_TO_PASS=tuple(f2p), PASS_TO_PASS=tuple(p2p), version="1.0",
                log_parser=DEFAULT_LOG_PARSER, repo_src=str(bundle.resolve()), test_cmd=DEFAULT_TEST_CMD,
                metadata=metadata)


# ------------------------------------------------------------------------------------ the multi tier

@dataclass(frozen=True)
class _Bug:
    module: Module
    source: str       # the module with the bug
    function: str
    family: str
    revealing: tuple[int, ...]
    shown: int        # the case whose failing test is visible at base_commit (and the issue's symptom)
    observed: str     # what the shown call does with the bug ("returns 3", "raises ...")


def _multi_task(index: int, seed: int, split: str, knobs: Knobs, out: Path, scratch: Path, warm: bool) -> Task:
    """Task `index` of the multi tier (crr.tasks.multi): candidates are tried until one has every bug revealed
    and measured."""
    n_bugs, style = knobs.draw(index, seed, split)
    instance_id = f"multi-{split}-{seed}-{index}"
    for attempt in range(MAX_ATTEMPTS):
        rng = keyed_random("multi", seed, split, index, attempt)
        work = scratch / f"{instance_id}-{attempt}"
        try:
            task = _multi_candidate(instance_id, n_bugs, style, knobs.distractors, split, rng, work, out, warm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if task is not None:
            return task
    raise CRRError(f"could not generate {instance_id} in {MAX_ATTEMPTS} attempts; this is a bug in crr's "
                   "multi generator, please report the seed and split")


def _multi_candidate(instance_id: str, n_bugs: int, style: str, distractors: int, split: str, rng: random.Random,
               work: Path, out: Path, warm: bool) -> Task | None:
    template, core = multi_template(rng, split, rng.randint(n_bugs, MAX_CORE_MODULES), distractors)
    package, modules = template.packages[0], list(template.modules)
    cases = [_Case(m.name, fn, args, m.name in core) for m in modules for fn, arg_list in m.cases.items()
             for args in arg_list]

    # 1. Expected values and candidate bugs (a few per buggy module, of shuffled families), in one probe.
    repo = work / "repo"
    files = _package_files(package, template, modules)
    _write(repo, files)
    groups = []
    for module in rng.sample([m for m in modules if m.name in core], n_bugs):
        families = list(NANO_FAMILIES)
        rng.shuffle(families)
        sites = []
        for family in families:
            found = mutants(module.source, family, rng)
            rng.shuffle(found)
            sites += [(module, mu) for mu in found[:2]]
        groups.append(sites[:SITES_PER_BUG])
    probe = _probe(repo, package, cases, [s for g in groups for s in g])
    reference = probe["reference"]
    unusable = {i for i, r in enumerate(reference) if "error" in r}
    results = iter(probe["mutants"])
    bugs = []
    for sites in groups:
        found = [(module, mu, res) for (module, mu), res in zip(sites, [next(results) for _ in sites])
                 if not res["timeout"] and len(set(res["revealing"]) - unusable) >= 2]
        if not found:  # each bug needs a visible failing test and a held-out one
            return None
        module, mu, res = found[0]
        revealing = sorted(set(res["revealing"]) - unusable)
        symptoms = sorted(revealing, key=lambda i: (len(cases[i].args) + len(res["observed"][str(i)]), i))
        shown = rng.choice(symptoms[:3])
        bugs.append(_Bug(module, mu.source, mu.function, mu.family, tuple(revealing), shown,
                         res["observed"][str(shown)]))

    # 2. Held out: every bug's failing cases but the shown one, plus two passing ones of the same function.
    held_out: set[int] = set()
    for bug in bugs:
        peers = [i for i, c in enumerate(cases) if c.module == bug.module.name and c.function == bug.function
                 and i not in bug.revealing and i not in unusable]
        held_out |= (set(bug.revealing) - {bug.shown}) | set(rng.sample(peers, min(2, len(peers))))

    # 3. The repository at base_commit: the bugs, one visible failing test per bug.
    for bug in bugs:
        files[f"{package}/{bug.module.name}.py"] = bug.source
    tests, test_ids = _test_files(package, cases, reference, held_out, sorted(unusable))
    base_commit = _initial_commit(repo, package, files, tests)

    # 4. Test patch and gold patch (every buggy module restored) as git diffs; F2P / P2P measured by pytest.
    test_patch = files_diff(repo, {f"tests/test_{t.module}.py": _render(t, held_out=True)
                                   for t in tests.values() if t.held_out})
    patch = files_diff(repo, {f"{package}/{bug.module.name}.py": bug.module.source for bug in bugs})
    pinned_git(repo, "apply", "-", stdin=test_patch)
    before = _pytest(repo, work.parent, warm, lean=warm)
    pinned_git(repo, "apply", "-", stdin=patch)
    after = _pytest(repo, work.parent, warm, lean=warm)
    if not after or any(status != "PASSED" for status in after.values()):
        return None
    f2p = [t for t in after if before.get(t) != "PASSED"]
    p2p = [t for t in after if before.get(t) == "PASSED"]
    for bug in bugs:  # each bug fails its shown test and a held-out one: no bug is fixed by fixing another
        own = {test_ids[i] for i in bug.revealing}
        if test_ids[bug.shown] not in f2p or not (own - {test_ids[bug.shown]}) & set(f2p):
            return None
    if not set(f2p) <= {test_ids[i] for bug in bugs for i in bug.revealing}:
        return None

    bundle = out / "repos" / f"{instance_id}.bundle"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    pinned_git(repo, "bundle", "create", "-q", str(bundle), "HEAD", "main")
    n_distractors = len(modules) - len(core)
    metadata = {
        "split": split, "template": "multi", "tier": "multi", "bug_family": bugs[0].family,
        "difficulty": ("easy", "easy", "medium", "hard", "hard")[n_bugs - 1 + ISSUE_STYLES.index(style)],
        "n_modules": len(modules), "n_decoys": n_distractors, "package": package,
        "buggy_file": f"{package}/{bugs[0].module.name}.py", "buggy_function": bugs[0].function, "flaky": None,
        "n_bugs": n_bugs, "issue_style": style, "n_distractors": n_distractors,
        "distractors": [f"{package}/{m.name}.py" for m in modules if m.name not in core],
        "bugs": [{"file": f"{package}/{b.module.name}.py", "function": b.function, "family": b.family,
                  "test": test_ids[b.shown]} for b in bugs],
    }
    return Task(instance_id=instance_id, repo="crr/multi", base_commit=base_commit,
                problem_statement=multi_issue(package, [
                    Symptom(b.module.name, b.function, cases[b.shown].args, reference[b.shown], b.observed,
                            test_ids[b.shown]) for b in bugs], style, rng),
                patch=patch, test_patch=test_patch, FAIL_TO_PASS=tuple(f2p), PASS_TO_PASS=tuple(p2p),
                version="1.0", log_parser=DEFAULT_LOG_PARSER, repo_src=str(bundle.resolve()),
                test_cmd=DEFAULT_TEST_CMD, run_tests_cmd=RUN_TESTS_CMD, metadata=metadata)


def _difficulty(n_modules: int, n_decoys: int, family: str, indirect: bool) -> str:
    """Tier from what makes localisation hard: package size, look-alike code, the bug's kind, and
    whether the symptom shows only through callers of the buggy function."""
    score = (0 if n_modules <= 5 else 1 if n_modules <= 11 else 2) + (n_decoys + 1) // 2 + FAMILIES[family] + indirect
    return "easy" if score <= 2 else "medium" if score <= 4 else "hard"


# ------------------------------------------------------------------------------------ files

def _package_files(package: str, template: Template, modules: list[Module]) -> dict[str, str]:
    names = ", ".join(f"`{m.name}`" for m in modules)
    files = {
        "README.md": f"# {package}\n\nA small library to {template.purpose}.\n\nModules: {names}.\n\n"
                     "Run the tests with `python -m pytest`.\n",
        "pyproject.toml": f'[project]\nname = "{package}"\nversion = "1.0.0"\nrequires-python = ">=3.9"\n\n'
                          '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
        f"{package}/__init__.py": f'"""{package}: {template.purpose}."""\n\n__version__ = "1.0.0"\n',
    }
    files.update({f"{package}/{m.name}.py": m.source for m in modules})
    return files


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _initial_commit(repo: Path, package: str, files: dict[str, str], tests: dict) -> str:
    """The repository at base_commit, made anew: the package's files and the visible tests, one commit."""
    shutil.rmtree(repo)
    _write(repo, {**files, **{f"tests/test_{t.module}.py": _render(t, held_out=False) for t in tests.values()}})
    pinned_git(repo, "init", "-q", "-b", "main")
    pinned_git(repo, "add", "-A")
    pinned_git(repo, "commit", "-q", "-m", f"{package}: initial import")
    return pinned_git(repo, "rev-parse", "HEAD").strip()


def _test_files(package: str, cases: list[_Case], reference: list[dict], held_out: set[int],
                unusable: list[int]) -> tuple[dict[str, _TestFile], dict[int, str]]:
    """One test file per tested module; returns the files and case index -> pytest node id."""
    files: dict[str, _TestFile] = {}
    test_ids: dict[int, str] = {}
    counters: dict[tuple[str, str], int] = {}
    for part in (False, True):  # visible tests first, so held-out ones continue their numbering
        for i, case in enumerate(cases):
            if i in unusable or (i in held_out) != part:
                continue
            tf = files.setdefault(case.module, _TestFile(case.module))
            key = (case.module, case.function)
            counters[key] = counters.get(key, 0) + 1
            name = f"test_{case.function}_{counters[key]}"
            call = f"{case.function}({case.args})"
            ref = reference[i]
            if "raises" in ref:
                body = f"    with pytest.raises({ref['raises']}):\n        {call}\n"
            elif isinstance(ast.literal_eval(ref["value"]), float):
                body = f"    assert {call} == pytest.approx({ref['value']})\n"
            else:
                body = f"    assert {call} == {ref['value']}\n"
            (tf.held_out if part else tf.visible).append(f"def {name}():\n{body}")
            test_ids[i] = f"tests/test_{case.module}.py::{name}"
    for module, tf in files.items():
        functions = list(dict.fromkeys(c.function for c in cases if c.module == module))
        tf.header = ["import pytest", "", f"from {package}.{module} import {', '.join(functions)}"]
    return files, test_ids


def _render(tf: _TestFile, held_out: bool) -> str:
    tests = tf.visible + (tf.held_out if held_out else [])
    return "\n".join(tf.header) + "\n\n\n" + "\n\n".join(tests)


def _decoy_functions(template: Template, bug: Mutant, bug_module: Module, n: int,
                     rng: random.Random) -> list[tuple[Module, str]]:
    """(module, function) pairs copied into a legacy module: the buggy function first (its copy
    keeps the bug, so fixing the copy fixes nothing), then other template functions."""
    if n == 0:
        return []
    others = [(m, f.name) for m in template.modules for f in ast.parse(m.source).body
              if isinstance(f, ast.FunctionDef) and f.name != bug.function]
    return [(bug_module, bug.function), *rng.sample(others, min(n - 1, len(others)))]


def _legacy_module(package: str, bug_module: Module, bug: Mutant, decoys: list[tuple[Module, str]]) -> str:
    imports: list[str] = []
    bodies: list[str] = []
    copied = {name for _, name in decoys}
    for module, name in decoys:
        source = bug.source if module is bug_module else module.source
        tree = ast.parse(source)
        func = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name)
        bodies.append(ast.get_source_segment(source, func))
        used = {n.id for n in ast.walk(func) if isinstance(n, ast.Name)}
        for stmt in tree.body:  # the module-level names the copy needs, imported from where they live
            if isinstance(stmt, ast.Import):
                imports += [f"import {a.name}" for a in stmt.names if (a.asname or a.name) in used]
            elif isinstance(stmt, ast.ImportFrom):
                pkg_rel = "." * stmt.level + (stmt.module or "")
                imports += [f"from {pkg_rel} import {a.name}" for a in stmt.names
                            if (a.asname or a.name) in used and a.name not in copied]
            else:
                defined = [stmt.name] if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) else [
                    t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)]
                imports += [f"from .{module.name} import {d}" for d in defined if d in used and d not in copied]
    doc = (f'"""Deprecated entry points kept for code written against {package} 0.x.\n\n'
           f'New code should import these from the modules they moved to.\n"""\n')
    head = "\n".join(dict.fromkeys(sorted(imports, key=lambda s: (not s.startswith("import"), s))))
    return doc + ("\n" + head + "\n" if head else "") + "\n\n" + "\n\n\n".join(bodies) + "\n"


# ------------------------------------------------------------------------------------ flaky tests

_FLAKY_WORDS = ("north", "south", "east", "west", "amber", "cobalt", "violet", "olive", "alpha", "delta")


def _plant_flaky(kind: str, tests: dict[str, _TestFile], template: Template, rng: random.Random) -> str:
    """Append a flaky test to a template module's visible tests; returns its node id."""
    module = rng.choice([m.name for m in template.modules if m.name in tests])
    tf = tests[module]
    stem = module
    if kind == "hash_seed":
        words = rng.sample(_FLAKY_WORDS, 4)
        literal = "{" + ", ".join(json.dumps(w) for w in words) + "}"
        order = _hash_seed_zero_order(literal)
        name = f"test_{stem}_labels_render_in_order"
        tf.visible.append(f"def {name}():\n    labels = {literal}\n"
                          f"    assert \", \".join(labels) == {json.dumps(order)}\n")
    elif kind == "test_order":
        word = rng.choice(_FLAKY_WORDS)
        name = f"test_{stem}_audit_log_starts_empty"
        tf.visible.append(f"_AUDIT_LOG = []\n\n\ndef {name}():\n    assert _AUDIT_LOG == []\n")
        tf.visible.append(f"def test_{stem}_audit_log_records():\n    _AUDIT_LOG.append({word!r})\n"
                          f"    assert _AUDIT_LOG[-1] == {word!r}\n")
    elif kind == "random":
        name = f"test_{stem}_jitter_in_upper_band"
        tf.header.insert(0, "import random")
        tf.visible.append(f"def {name}():\n    jitter = random.random()\n    assert jitter >= 0.5\n")
    elif kind == "time":
        name = f"test_{stem}_clock_token_is_even"
        tf.header.insert(0, "import time")
        tf.visible.append(f"def {name}():\n    token = time.time_ns() // 1000\n    assert token % 2 == 0\n")
    else:
        raise ValueError(f"unknown flaky kind {kind!r}")
    return f"tests/test_{module}.py::{name}"


def _hash_seed_zero_order(literal: str) -> str:
    """How the set literal iterates under PYTHONHASHSEED=0, the seed the measuring runs use."""
    out = subprocess.run([sys.executable, "-c", f"print(', '.join({literal}))"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, check=True)
    return out.stdout.strip()


# ------------------------------------------------------------------------------------ issue text

def issue_text(rng: random.Random, package: str, template: Template, case: _Case, reference: dict, observed: str,
           short: bool = False) -> str:
    """A title and a body in one of three styles (`short`: always the one-sentence one, for nano)."""
    call = f"{case.function}({case.args})"
    expected = f"`{reference['value']}`" if "value" in reference else f"a `{reference['raises']}`"
    raised = observed.startswith("raises ")
    observed_md = f"raises `{observed[7:]}`" if raised else f"returns `{observed[8:]}`"
    if raised:
        title = f"{case.function}() raises {observed[7:].split(':')[0]} for valid input"
    else:
        title = rng.choice((f"`{case.function}` gives a wrong result",
                            f"Unexpected output from {package}.{case.module}.{case.function}",
                            f"{case.function}() returns the wrong value"))
    if "raises" in reference:
        expected_line = f"I expected it to raise {expected}."
    else:
        expected_line = f"I expected {expected}."
    style = 2 if short else rng.randrange(3)
    if style == 0:
        shown = f"Traceback (most recent call last):\n  ...\n{observed[7:]}" if raised else observed[8:]
        body = (f"I'm using {package} to {template.purpose}. This call gives the wrong answer:\n\n"
                f"```python\n>>> from {package}.{case.module} import {case.function}\n>>> {call}\n{shown}\n```\n\n"
                f"{expected_line}")
    elif style == 1:
        body = (f"**Describe the bug**\n`{call}` {observed_md}.\n\n**To reproduce**\n```python\n"
                f"from {package}.{case.module} import {case.function}\nprint({call})\n```\n\n"
                f"**Expected behaviour**\n{expected_line}")
    else:
        body = (f"Calling `{package}.{case.module}.{case.function}({case.args})` {observed_md}. "
                f"{expected_line}" + ("" if short else " Could someone take a look?"))
    return f"{title}\n\n{body}\n"


# ------------------------------------------------------------------------------------ processes

def pinned_git(repo: Path, *args: str, stdin: str | None = None) -> str:
    """git with the pinned identity/dates and no user config (crr.sandbox.checkout's helper uses the
    user's environment, which would make base_commit and the diffs machine-dependent)."""
    out = subprocess.run(["git", *args], check=False, cwd=repo, input=stdin, capture_output=True, text=True,
                         env={**os.environ, **_GIT_ENV})
    if out.returncode != 0:
        raise CRRError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()[-400:]}")
    return out.stdout


def files_diff(repo: Path, files: dict[str, str]) -> str:
    """The unified diff that turns base_commit into base_commit + `files`; the tree is reset after."""
    _write(repo, files)
    pinned_git(repo, "add", "-A")
    try:
        return pinned_git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "--full-index")
    finally:
        pinned_git(repo, "reset", "-q", "--hard")


def _probe(repo: Path, package: str, cases: list[_Case], sites: list[tuple[Module, Mutant]]) -> dict:
    request = {"root": str(repo), "package": package,
               "cases": [{"module": c.module, "function": c.function, "args": c.args} for c in cases],
               "mutants": [{"file": f"{package}/{m.name}.py", "source": mu.source} for m, mu in sites],
               "probe_cases": [i for i, c in enumerate(cases) if c.core]}
    out = subprocess.run([sys.executable, "-m", "crr.tasks.probe"], check=False, input=json.dumps(request), text=True,
                         capture_output=True, timeout=PYTEST_TIMEOUT_S, env=_pinned_env())
    if out.returncode != 0:
        raise CRRError(f"the micro probe failed: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout)


def _pinned_env(plugin_dir: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
    if plugin_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")]))
    return env


_WARM: dict[Path, WarmPytest] = {}  # plugin dir -> this process's warm pytest worker


def _close_warm() -> None:
    while _WARM:
        _WARM.popitem()[1].close()


# pytest's built-in plugins a nano test (asserts on pure functions' results, pytest.raises, pytest.approx; no
# fixtures, output, warnings or logging) never reaches: off, a run costs ~40% less CPU. Nano's warm runs only;
# tests/test_nano.py checks that the rows equal those of fresh runs with every plugin on.
_LEAN_OFF = ("doctest", "junitxml", "pastebin", "nose", "legacypath", "stepwise", "setuponly", "setupplan",
             "unraisableexception", "threadexception", "faulthandler", "logging", "warnings", "tmpdir",
             "monkeypatch", "capture")


def _pytest(repo: Path, plugin_dir: Path, warm: bool = False, lean: bool = False) -> dict[str, str]:
    """Test id -> status of one pinned pytest run, read by swebench's pytest parser."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    # plain asserts and no timeout plugin only make the run faster; outcomes are the same
    args = ["-rA", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:timeout", "--assert=plain",
            "-p", _PIN_MODULE]
    if lean:
        args += [arg for name in _LEAN_OFF for arg in ("-p", f"no:{name}")]
    if warm:
        if plugin_dir not in _WARM:
            _WARM[plugin_dir] = WarmPytest(_pinned_env(plugin_dir))
        output = _WARM[plugin_dir].run(repo, args, PYTEST_TIMEOUT_S)
        return {} if output is None else PARSER_REGISTRY[DEFAULT_LOG_PARSER](output, None)
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", *args], check=False, cwd=repo, capture_output=True,
                             text=True, timeout=PYTEST_TIMEOUT_S, env=_pinned_env(plugin_dir))
    except subprocess.TimeoutExpired:
        return {}
    return PARSER_REGISTRY[DEFAULT_LOG_PARSER](out.stdout, None)
