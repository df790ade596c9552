"""`crr tasks synth`: SWE-bench-format tasks from real PyPI packages, by SWE-smith's recipe.

  1. the package's sdist (sha256-checked) becomes a git repository (crr.tasks.sdist);
  2. pytest, what its PKG-INFO declares and any extra test requirements are locked into the package
     mirror (crr.sandbox.mirror) and installed in a sandbox: no network beyond that;
  3. its own test suite runs there; the tests that pass are the candidates;
  4. SWE-smith's procedural modifiers (swesmith.bug_gen.procedural: operator, control-flow, removal
     and class rewrites over the functions and classes swesmith's adapter extracts) rewrite one
     entity at a time, in a seeded order; each candidate bug runs the suite in a fork of the
     sandbox, and a bug is kept when at least one passing test breaks;
  5. a kept bug becomes a task row: base_commit = the bug, with the test files that caught it
     removed; test_patch = those files back; patch = the fix; FAIL_TO_PASS = the tests it broke and
     PASS_TO_PASS = the rest of those files that still passed (both measured); the issue is written
     from one failing test: its source and the error it fails with.

Rows carry no repository: `sdist` pins the archive and `materialise` rebuilds base_commit from it
(cached; the commit is checked), so a committed task set holds only rows and anyone can run it.
An output directory is filled package by package; the same command resumes an interrupted run.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import re
import shlex
import shutil
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import InvalidName, canonicalize_name
from unidiff import PatchSet

from crr.errors import CRRError
from crr.sandbox import engine_workers, get_engine, mirror
from crr.sandbox.base import SCRATCH_DIR, ForkEngine, Sandbox
from crr.sandbox.checkout import cached_repo
from crr.rundir import atomic_write_text
from crr.seeds import keyed_random
from crr.tasks.loaders import TASKS_FILE, read_tasks_jsonl, write_tasks
from crr.tasks.micro import files_diff, pinned_git
from crr.tasks.schema import DEFAULT_LOG_PARSER, DEFAULT_TEST_CMD, Task
from crr.tasks.sdist import Sdist, declared_requirements, find, import_roots, pristine_repo

log = logging.getLogger(__name__)

PYTEST = "pytest==8.3.5"  # the runner every synthesised environment pins
PYTEST_COV = "pytest-cov==6.1.1"  # for suites whose pytest options name coverage flags (run with --no-cov)
PACKAGES_FILE = Path(__file__).with_name("packages.yaml")
SETTINGS_FILE = "synth.json"
SUITE_TIMEOUT_S = 900      # the unmodified suite
DEFAULT_MAX_CANDIDATES = 30  # candidate bugs run per package before giving up on more tasks
_LOG = f"{SCRATCH_DIR}/synth.log"
_TEST_DIRS = {"tests", "test", "testing"}
_NOT_SOURCE = {"docs", "doc", "examples", "example", "benchmarks", "bench", "scripts", "build"}


@dataclass(frozen=True)
class PackageSpec:
    """A package to synthesise from: NAME==VERSION, extra test requirements, its test command."""

    name: str
    version: str
    requires: tuple[str, ...] = ()
    test_cmd: str = DEFAULT_TEST_CMD


@dataclass(frozen=True)
class _Bug:
    path: str         # the file it changes, relative to the repository root
    source: str       # that file with the bug
    strategy: str     # the swesmith modifier's name, e.g. func_pm_op_swap
    explanation: str  # the modifier's explanation
    entity: str       # the function or class it rewrote


@dataclass
class SynthProgress:
    """What `synthesise` reports as it goes (for a progress bar)."""

    package: str = ""
    candidates: int = 0
    tasks: int = 0


def parse_package(text: str, requires: tuple[str, ...] = ()) -> PackageSpec:
    name, sep, version = text.partition("==")
    if not sep or not name.strip() or not version.strip():
        raise CRRError(f"--package takes NAME==VERSION (a pinned release), got {text!r}")
    try:
        canonicalize_name(name.strip(), validate=True)
    except InvalidName:
        raise CRRError(f"--package {text!r}: {name.strip()!r} is not a valid package name") from None
    for requirement in requires:
        try:
            Requirement(requirement)
        except InvalidRequirement as e:
            raise CRRError(f"--requires {requirement!r} is not a requirement ({str(e).splitlines()[0]}); "
                           "give e.g. hypothesis==6.100.0") from None
    return PackageSpec(name.strip(), version.strip(), tuple(requires))


def curated() -> list[PackageSpec]:
    """The curated packages of crr/tasks/packages.yaml."""
    rows = yaml.safe_load(PACKAGES_FILE.read_text())["packages"]
    return [PackageSpec(r["name"], str(r["version"]), tuple(r.get("requires", ())),
                        r.get("test_cmd", DEFAULT_TEST_CMD)) for r in rows]


# ------------------------------------------------------------------------------------ many packages

def synthesise(specs: list[PackageSpec], out: Path | str, n: int, seed: int = 0, engine: str = "local",
               engine_opts: dict | None = None, max_candidates: int = DEFAULT_MAX_CANDIDATES,
               progress: Callable[[SynthProgress], None] | None = None) -> list[Task]:
    """Up to `n` tasks per package into `out` (tasks.jsonl; per-package parts under packages/).

    A directory made by an earlier run with the same settings is resumed: finished packages are
    kept. Every package is looked up on the index before anything is written."""
    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    if max_candidates < 1:
        raise CRRError(f"--max-candidates must be at least 1, got {max_candidates}")
    if not specs:
        raise CRRError("give --package NAME==VERSION (one or more) or --curated")
    releases = [(canonicalize_name(s.name), s.version) for s in specs]
    if twice := next((r for r in releases if releases.count(r) > 1), None):
        raise CRRError(f"{twice[0]} {twice[1]} is named twice (by --package, or by --package and --curated); "
                       "name each release once")
    out = Path(out)
    settings = {"packages": [asdict(s) for s in specs], "n": n, "seed": seed, "max_candidates": max_candidates}
    started = (out / SETTINGS_FILE).is_file() and any((out / "packages").glob("*.jsonl"))
    if started:
        if json.loads((out / SETTINGS_FILE).read_text()) != json.loads(json.dumps(settings)):
            raise CRRError(f"{out} was made by `crr tasks synth` with other settings; use a new --out")
    elif out.exists() and (not out.is_dir() or set(out.iterdir()) - {out / SETTINGS_FILE, out / "packages"}):
        raise CRRError(f"{out} already exists and is not an empty directory; choose a new --out "
                       "(nothing was written)")
    sdists = {spec: find(spec.name, spec.version) for spec in specs}
    atomic_write_text(out / SETTINGS_FILE, json.dumps(settings, indent=2, sort_keys=True) + "\n")
    parts = {spec: out / "packages" / f"{sdists[spec].name}-{spec.version}.jsonl" for spec in specs}
    todo = [spec for spec in parts if not parts[spec].is_file()]   # each package once

    def one(spec: PackageSpec) -> None:
        tasks = synth_package(spec, n, seed, eng, sdist=sdists[spec], max_candidates=max_candidates,
                              progress=progress)
        write_tasks(tasks, parts[spec])

    with get_engine(engine, **(engine_opts or {})) as eng:
        # One package at a time; on a Ray engine as many at once as its cluster has sandbox slots (a
        # package's candidate bugs run in forks of its own sandbox, on that sandbox's node).
        workers = min(len(todo), engine_workers(eng, None, 1))
        if workers <= 1:
            for spec in todo:
                one(spec)
        else:
            pool = ThreadPoolExecutor(workers, thread_name_prefix="crr-synth")
            try:
                for future in [pool.submit(one, spec) for spec in todo]:
                    future.result()
            finally:  # also on an error or Ctrl-C: queued packages never start, sandboxes in flight close
                pool.shutdown(wait=False, cancel_futures=True)
                eng.close()
                pool.shutdown(wait=True)
    tasks = [t for spec in specs for t in read_tasks_jsonl(parts[spec])]
    write_tasks(tasks, out / TASKS_FILE)
    return tasks


# ------------------------------------------------------------------------------------ one package

def synth_package(spec: PackageSpec, n: int, seed: int, engine: ForkEngine, sdist: Sdist | None = None,
                  max_candidates: int = DEFAULT_MAX_CANDIDATES,
                  progress: Callable[[SynthProgress], None] | None = None) -> list[Task]:
    """Up to `n` tasks from one package (module doc, steps 1-5), each checked to rebuild from its row."""
    sdist = sdist or find(spec.name, spec.version)
    state = SynthProgress(package=f"{sdist.name} {sdist.version}")
    work = Path(tempfile.mkdtemp(prefix=f"crr-synth-{sdist.name}-"))
    try:
        repo = work / "repo"
        pristine = pristine_repo(sdist, repo)
        tests = [p for p in _python_files(repo) if _is_test_file(p)]
        if not tests:
            raise CRRError(f"{sdist.name} {sdist.version}'s sdist carries no tests (no test_*.py, *_test.py or "
                           "tests/ directory); pick a package whose sdist ships its test suite")
        test_cmd, implied = _pytest_setup(spec.test_cmd, repo)
        spec = dataclasses.replace(spec, test_cmd=test_cmd)
        # the metadata build runs the sdist's own code: in a container of the Docker engine's base image there
        docker_engine = engine if engine.name == "docker" else None
        lines = mirror.lock([PYTEST, *implied, *declared_requirements(repo, docker_engine), *spec.requires])
        probe = Task(instance_id=f"{sdist.name}-{sdist.version}", repo=f"pypi/{sdist.name}", base_commit=pristine,
                     problem_statement="", patch="", test_patch="", FAIL_TO_PASS=(), PASS_TO_PASS=(),
                     version=sdist.version, repo_src=str(repo), test_cmd=spec.test_cmd,
                     mirror={"requirements": lines})
        tasks: list[Task] = []
        with engine.start(probe) as sb:
            start = time.monotonic()
            baseline, text, _ = _run_suite(sb, spec.test_cmd, SUITE_TIMEOUT_S)
            timeout = max(60.0, 10 * (time.monotonic() - start))
            passing = {t for t, s in baseline.items() if s == "PASSED" and _usable_id(t)}
            if not passing:
                tail = "\n".join(text.strip().splitlines()[-15:])
                raise CRRError(f"{sdist.name} {sdist.version}: its test suite passes no test in the sandbox "
                               f"({spec.test_cmd!r}); add what it needs with --requires. Log tail:\n{tail}")
            log.info("%s: %d of %d tests pass unmodified", state.package, len(passing), len(baseline))
            snapshot = sb.snapshot()
            rng = keyed_random("crr-synth", seed, sdist.name, sdist.version)
            with contextlib.closing(_candidate_bugs(repo, rng)) as bugs:
                for bug in bugs:
                    if len(tasks) >= n or state.candidates >= max_candidates:
                        break
                    state.candidates += 1
                    with engine.restore(snapshot) as fork:
                        fork.write_file(bug.path, bug.source.encode())
                        statuses, text, timed_out = _run_suite(fork, spec.test_cmd, timeout)
                    broken = sorted(t for t in passing if statuses.get(t) != "PASSED")
                    if timed_out or not statuses or not broken:
                        log.info("%s: %s on %s: %s", state.package, bug.strategy, bug.entity,
                                 "timed out" if timed_out else "no results" if not statuses else "no test broke")
                    else:
                        tasks.append(_task(spec, sdist, lines, repo, pristine, bug, broken, passing, statuses,
                                           text, seed, rng))
                        state.tasks += 1
                        log.info("%s: %s on %s broke %d tests: %s", state.package, bug.strategy, bug.entity,
                                 len(broken), tasks[-1].instance_id)
                    if progress:
                        progress(state)
            engine.release(snapshot)
        for task in tasks:
            materialise(task)  # proves the row rebuilds its base_commit, and warms the cache
        if not tasks:
            log.warning("%s: none of %d candidate bugs broke a passing test", state.package, state.candidates)
        return tasks
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pytest_setup(test_cmd: str, repo: Path) -> tuple[str, list[str]]:
    """`test_cmd` as the repository needs it under pytest, and the test requirements its pytest configuration
    implies: its import roots (a src/ layout's src) on the path, unless the configuration sets a path itself,
    so that the tests import the code under /testbed as an install would; plain output where it forces colour
    (log parsers read no ANSI); pytest-cov, switched off, where its options name coverage flags."""
    if "pytest" not in test_cmd:
        return test_cmd, []
    config = "\n".join((repo / f).read_text(errors="replace") for f in ("pytest.ini", "pyproject.toml", "setup.cfg",
                                                                       "tox.ini") if (repo / f).is_file())
    requires = []
    if (roots := import_roots(repo)) and "pythonpath" not in config:
        test_cmd += f" -o {shlex.quote('pythonpath=' + ' '.join(roots))}"
    if "--color" in config:
        test_cmd += " --color=no"
    if "--cov" in config:
        test_cmd += " --no-cov"
        requires.append(PYTEST_COV)
    return test_cmd, requires


def _run_suite(sb: Sandbox, test_cmd: str, timeout: float) -> tuple[dict[str, str], str, bool]:
    """Test id -> status of one run of the whole suite (swebench's pytest parser), its log, timed out."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    run = sb.exec(f"mkdir -p {SCRATCH_DIR} && {test_cmd} > {_LOG} 2>&1", timeout=timeout)
    text = sb.read_file(_LOG).decode("utf-8", errors="replace")
    return PARSER_REGISTRY[DEFAULT_LOG_PARSER](text, None), text, run.timed_out


def _candidate_bugs(repo: Path, rng: random.Random) -> Iterator[_Bug]:
    """SWE-smith's procedural bugs over the package's source (not its tests), in a seeded order;
    every modifier gets its own seed, so the order and the bugs are reproducible."""
    try:
        from swesmith.bug_gen.adapters.python import get_entities_from_file_py
        from swesmith.bug_gen.procedural.python import MODIFIERS_PYTHON
        from swesmith.bug_gen.utils import apply_code_change
    except ImportError as e:
        raise CRRError(f"crr tasks synth injects bugs with SWE-smith, which is not installed ({e}); "
                       "pip install 'crr[synth]'") from None

    scratch = Path(tempfile.mkdtemp(prefix="crr-synth-bugs-"))
    try:
        shutil.copytree(repo, scratch / "repo", ignore=shutil.ignore_patterns(".git"))
        entities: list = []
        for rel in _python_files(repo):
            if not _is_test_file(rel) and not set(Path(rel).parts) & _NOT_SOURCE and Path(rel).name != "setup.py":
                get_entities_from_file_py(entities, str(scratch / "repo" / rel))
        pairs = [(e, pm) for e in entities for pm in MODIFIERS_PYTHON if pm.can_change(e)]
        rng.shuffle(pairs)
        seen: set[str] = set()
        for entity, pm in pairs:
            bug = type(pm)(likelihood=pm.likelihood, seed=rng.random()).modify(entity)
            if bug is None:
                continue
            path = Path(entity.file_path)
            original = path.read_text()
            apply_code_change(entity, bug)
            mutated = path.read_text()
            path.write_text(original)
            rel = str(path.relative_to(scratch / "repo"))
            key = hashlib.sha256(f"{rel}\0{mutated}".encode()).hexdigest()
            if mutated != original and key not in seen:
                seen.add(key)
                yield _Bug(rel, mutated, pm.name, bug.explanation, entity.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _task(spec: PackageSpec, sdist: Sdist, lines: list[str], repo: Path, pristine: str, bug: _Bug,
          broken: list[str], passing: set[str], statuses: dict[str, str], text: str, seed: int,
          rng: random.Random) -> Task:
    """The task row of a kept bug (module doc, step 5); `repo` is left at `pristine`."""
    held_files = sorted({t.split("::")[0] for t in broken})
    p2p = sorted(t for t in passing if t.split("::")[0] in held_files and statuses.get(t) == "PASSED")
    instance_id = (f"{sdist.name}-{sdist.version}__{bug.strategy}__"
                   f"{hashlib.sha256(f'{bug.path}{bug.source}'.encode()).hexdigest()[:8]}")
    pristine_files = {p: pinned_git(repo, "show", f"{pristine}:{p}") for p in [bug.path, *held_files]}
    problem = _issue(sdist, broken, pristine_files, text, rng)
    pinned_git(repo, "checkout", "-q", "--detach", pristine)
    (repo / bug.path).write_text(bug.source)
    base_commit = _commit(repo, held_files, instance_id)
    patch = files_diff(repo, {bug.path: pristine_files[bug.path]})
    test_patch = files_diff(repo, {p: pristine_files[p] for p in held_files})
    pinned_git(repo, "checkout", "-q", "--detach", pristine)
    return Task(instance_id=instance_id, repo=f"pypi/{sdist.name}", base_commit=base_commit,
                problem_statement=problem, patch=patch, test_patch=test_patch, FAIL_TO_PASS=tuple(broken),
                PASS_TO_PASS=tuple(p2p), version=sdist.version, test_cmd=spec.test_cmd,
                mirror={"requirements": list(lines)}, sdist=sdist.row(),
                metadata={"package": sdist.name, "bug_strategy": bug.strategy,
                          "bug_explanation": bug.explanation, "buggy_file": bug.path,
                          "buggy_entity": bug.entity, "generator": "swesmith procedural", "seed": seed})


def _commit(repo: Path, removed: list[str], message: str) -> str:
    """Commit the working tree with `removed` deleted (micro's fixed identity and date)."""
    if removed:
        pinned_git(repo, "rm", "-q", "--", *removed)
    pinned_git(repo, "add", "-A")
    pinned_git(repo, "commit", "-q", "-m", message)
    return pinned_git(repo, "rev-parse", "HEAD").strip()


def materialise(task: Task) -> Path:
    """A git repository holding the task's base_commit, rebuilt from its sdist row (cached): the
    pristine sdist commit, the gold patch reversed and the test patch's files removed."""
    if not task.sdist:
        raise CRRError(f"task {task.instance_id} has neither repo_src nor sdist; it cannot be checked out")
    sdist = Sdist.from_row(task.sdist)

    def rebuild(repo: Path) -> None:
        pristine_repo(sdist, repo)
        pinned_git(repo, "apply", "-R", "-", stdin=task.patch)
        removed = [f.path for f in PatchSet(task.test_patch) if f.is_added_file] if task.test_patch.strip() else []
        commit = _commit(repo, removed, task.instance_id)
        if commit != task.base_commit:
            raise CRRError(f"task {task.instance_id}: rebuilding it from {sdist.filename} gave commit {commit[:12]}, "
                           f"not its base_commit {task.base_commit[:12]}; the row does not match its sdist")

    return cached_repo("synth-repos", task, task.base_commit[:12], rebuild)


# ------------------------------------------------------------------------------------ files and ids

def _python_files(repo: Path) -> list[str]:
    return sorted(str(p.relative_to(repo)) for p in repo.rglob("*.py")
                  if ".git" not in p.relative_to(repo).parts and p.is_file())


def _is_test_file(rel: str) -> bool:
    path = Path(rel)
    return (path.name.startswith("test") or path.stem.endswith(("_test", "_tests"))
            or bool(set(path.parts[:-1]) & _TEST_DIRS)) and path.name != "conftest.py"


def _usable_id(test_id: str) -> bool:
    """A test of a test file whose id survived swebench's whitespace split (ids with spaces do not)."""
    file = test_id.split("::")[0]
    return "::" in test_id and _is_test_file(file) and ("[" not in test_id or test_id.endswith("]"))


# ------------------------------------------------------------------------------------ issue text

def _issue(sdist: Sdist, broken: list[str], files: dict[str, str], log_text: str, rng: random.Random) -> str:
    """An issue written from one failing test: its source (the tests are hidden at base_commit) and
    the error it fails with, plus how many others fail."""
    sources = {t: _test_source(files[t.split("::")[0]], t) for t in broken[:20]}
    shortest = sorted(sources, key=lambda t: (len(sources[t] or "x" * 10_000), t))[:3]
    shown = rng.choice(shortest)
    name = shown.split("::")[-1]
    error = _failure(log_text, shown)
    title = rng.choice((f"`{name}` fails on {sdist.name} {sdist.version}",
                        f"{sdist.name}: wrong behaviour caught by {name}",
                        f"Regression in {sdist.name} {sdist.version}: {name} fails"))
    body = [f"Running {sdist.name}'s test suite, `{shown}` fails."]
    if sources[shown]:
        body.append(f"The test:\n\n```python\n{sources[shown]}\n```")
    body.append(f"The error:\n\n```\n{error}\n```")
    others = [t for t in broken if t != shown]
    if others:
        listed = ", ".join(f"`{t}`" for t in others[:5])
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        body.append(f"Other failing tests: {listed}{more}.")
    body.append("The tests themselves look right to me, so I think the bug is in the library.")
    return f"{title}\n\n" + "\n\n".join(body) + "\n"


def _test_source(source: str, test_id: str) -> str | None:
    """The source of the test function (or method) `test_id` names, dedented; None if not found."""
    names = [re.sub(r"\[.*\]$", "", part) for part in test_id.split("::")[1:]]
    try:
        scope: list[ast.stmt] = ast.parse(source).body
    except SyntaxError:
        return None
    node = None
    for name in names:
        node = next((s for s in scope if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and s.name == name), None)
        if node is None:
            return None
        scope = node.body
    segment = ast.get_source_segment(source, node)
    return textwrap.dedent(" " * node.col_offset + segment) if segment else None


def _failure(log_text: str, test_id: str) -> str:
    """The `E` lines pytest printed for the test's failure, or its short-summary message."""
    head = ".".join(test_id.split("::")[1:])
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(rf"_+ {re.escape(head)} _+", line.strip()):
            errors = []
            for body in lines[i + 1:]:
                if re.fullmatch(r"_{3,} .* _{3,}|={3,}.*", body.strip()):
                    break
                if body.startswith("E "):
                    errors.append(body[2:].strip())
            if errors:  # without object addresses, which differ from run to run
                return re.sub(r" at 0x[0-9a-f]+", "", "\n".join(errors[:15]))
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")) and test_id in line:
            return line.partition(" - ")[2] or line
    return "(the test fails; pytest printed no message)"
