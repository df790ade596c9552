"""The multi tier: nano packages where several decisions of an episode matter.

A nano task is view -> edit -> submit: the issue names the module and the function, and one edit decides. A
multi task keeps nano's learnable pieces (procedural split-disjoint names, functions whose docstrings state
what they compute, crr.tasks.bugs' one-line bugs) and adds what makes finding and checking the code a choice:

* **Bugs per task** (`bugs`): 1-3, each in a different function of a different module. The reward stays binary
  (every FAIL_TO_PASS and PASS_TO_PASS test must pass), so a failed trajectory can hold correct edits.
* **Issue text** (`issue`): `named` gives each failing call with its module path (`pkg.mod.fn(2, 5)` returns
  `-13`, I expected `17`), as nano does; `symptom` gives the failing call and its expected and actual values
  without the module (`fn(2, 5)` returns `-13`): the agent finds where `fn` lives; `test_id` gives only the
  failing tests' ids, so the call and the values are in the test file or the test run.
* **Distractors** (`distractors`): up to that many look-alike modules, each beside a module of the package
  with a near-identical name (`kelo.py` / `kelos.py`) and functions with near-identical names and the same
  shapes (`bramu` / `brami`), tested and correct; bugs are never in them.
* **Running tests mid-episode**: one failing test per bug is visible at base_commit (the rest of each bug's
  failing cases are held out), so `run_tests` shows what is still broken after each edit.

Each task's (bugs, issue) pair comes from a seed-shuffled cycle over the knobs' product, so a set holds the
settings in equal shares; both are recorded in the row's metadata with the distractor count and every bug.
The rows are built by crr.tasks.micro's path: real git repositories, real pytest runs before and after the
gold patch, swebench's parser measuring FAIL_TO_PASS / PASS_TO_PASS.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from crr.errors import CRRError
from crr.tasks.bugs import mutants
from crr.tasks.micro import (
    MAX_ATTEMPTS,
    _Case,
    _package_files,
    _probe,
    _pytest,
    _render,
    _test_files,
    _write,
    files_diff,
    pinned_git,
)
from crr.tasks.nano import NANO_FAMILIES, SHAPES, Vocabulary, helpers_module, make_function
from crr.tasks.schema import DEFAULT_LOG_PARSER, DEFAULT_TEST_CMD, Task
from crr.tasks.templates import Module, Template

ISSUE_STYLES = ("named", "symptom", "test_id")
BUG_COUNTS = (1, 2, 3)
MAX_CORE_MODULES = 3
SITES_PER_BUG = 6  # candidate mutants probed per buggy module


@dataclass(frozen=True)
class Knobs:
    """The multi tier's settings: the bug counts and issue styles a set cycles through, and at most how many
    look-alike modules a task gets."""
    bugs: tuple[int, ...] = BUG_COUNTS
    issue: tuple[str, ...] = ISSUE_STYLES
    distractors: int = 2

    def __post_init__(self) -> None:
        if not self.bugs or any(b not in BUG_COUNTS for b in self.bugs):
            raise CRRError(f"--bugs takes counts among {', '.join(map(str, BUG_COUNTS))}, got {list(self.bugs)}")
        if not self.issue or any(s not in ISSUE_STYLES for s in self.issue):
            raise CRRError(f"--issue takes styles among {', '.join(ISSUE_STYLES)}, got {list(self.issue)}")
        if not 0 <= self.distractors <= MAX_CORE_MODULES:
            raise CRRError(f"--distractors must be between 0 and {MAX_CORE_MODULES}, got {self.distractors}")

    @classmethod
    def parse(cls, bugs: str, issue: str, distractors: int) -> Knobs:
        """From the CLI's comma-separated lists, e.g. ("1,2", "symptom,test_id", 2)."""
        try:
            counts = tuple(int(b) for b in bugs.split(","))
        except ValueError:
            raise CRRError(f"--bugs takes comma-separated counts such as 1,2,3, got {bugs!r}") from None
        return cls(counts, tuple(s.strip() for s in issue.split(",")), distractors)

    def draw(self, index: int, seed: int, split: str) -> tuple[int, str]:
        """Task `index`'s (bug count, issue style): a seed-shuffled cycle over the product, equal shares."""
        combos = [(b, s) for b in self.bugs for s in self.issue]
        random.Random(f"multi:{seed}:{split}:order").shuffle(combos)
        return combos[index % len(combos)]


def multi_template(rng: random.Random, split: str, n_core: int, distractors: int) -> tuple[Template, set[str]]:
    """A package of `n_core` nano modules plus up to `distractors` look-alike modules; returns it and the names
    of the core modules (where bugs go). Modules are in name order, so a look-alike sits beside its original."""
    vocab = Vocabulary(split, rng)
    package = vocab.word((2, 3))
    core, shapes = [], {}
    for _ in range(n_core):
        name = vocab.word((2, 3))
        chosen = rng.sample(sorted(SHAPES), rng.randint(2, 4))
        functions = [make_function(shape, vocab, rng) for shape in chosen]
        shapes[name] = [(fn, shape) for (fn, _, _), shape in zip(functions, chosen)]
        core.append(helpers_module(name, functions))
    twins = []
    for module in rng.sample(core, min(distractors, len(core))):
        twin = vocab.near(module.name)
        functions = [make_function(shape, vocab, rng, name=near) for fn, shape in shapes[module.name]
                     if (near := vocab.near(fn)) is not None]
        if twin is not None and functions:
            twins.append(helpers_module(twin, functions))
    modules = tuple(sorted([*core, *twins], key=lambda m: m.name))
    return (Template(name="multi", split=split, packages=(package,), purpose=f"use {package}'s helpers",
                     modules=modules), {m.name for m in core})


@dataclass(frozen=True)
class _Bug:
    module: Module
    source: str       # the module with the bug
    function: str
    family: str
    revealing: tuple[int, ...]
    shown: int        # the case whose failing test is visible at base_commit (and the issue's symptom)
    observed: str     # what the shown call does with the bug ("returns 3", "raises ...")


def multi_task(index: int, seed: int, split: str, knobs: Knobs, out: Path, scratch: Path, warm: bool) -> Task:
    """Task `index` of the multi tier: candidates are tried until one has every bug revealed and measured."""
    n_bugs, style = knobs.draw(index, seed, split)
    instance_id = f"multi-{split}-{seed}-{index}"
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"multi:{seed}:{split}:{index}:{attempt}")
        work = scratch / f"{instance_id}-{attempt}"
        try:
            task = _candidate(instance_id, n_bugs, style, knobs.distractors, split, rng, work, out, warm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if task is not None:
            return task
    raise CRRError(f"could not generate {instance_id} in {MAX_ATTEMPTS} attempts; this is a bug in crr's "
                   "multi generator, please report the seed and split")


def _candidate(instance_id: str, n_bugs: int, style: str, distractors: int, split: str, rng: random.Random,
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
    shutil.rmtree(repo)
    _write(repo, {**files, **{f"tests/test_{t.module}.py": _render(t, held_out=False) for t in tests.values()}})
    pinned_git(repo, "init", "-q", "-b", "main")
    pinned_git(repo, "add", "-A")
    pinned_git(repo, "commit", "-q", "-m", f"{package}: initial import")
    base_commit = pinned_git(repo, "rev-parse", "HEAD").strip()

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
                problem_statement=multi_issue(package, bugs, cases, reference, test_ids, style, rng),
                patch=patch, test_patch=test_patch, FAIL_TO_PASS=tuple(f2p), PASS_TO_PASS=tuple(p2p),
                version="1.0", log_parser=DEFAULT_LOG_PARSER, repo_src=str(bundle.resolve()),
                test_cmd=DEFAULT_TEST_CMD, metadata=metadata)


def multi_issue(package: str, bugs: list[_Bug], cases: list[_Case], reference: list[dict],
                test_ids: dict[int, str], style: str, rng: random.Random) -> str:
    """The issue: one line per bug, in a shuffled order, at the detail `style` allows."""
    lines = []
    for bug in rng.sample(bugs, len(bugs)):
        case, ref = cases[bug.shown], reference[bug.shown]
        if style == "test_id":
            lines.append(f"`{test_ids[bug.shown]}` fails.")
            continue
        raised = bug.observed.startswith("raises ")
        got = f"raises `{bug.observed[7:]}`" if raised else f"returns `{bug.observed[8:]}`"
        want = f"I expected `{ref['value']}`." if "value" in ref else f"I expected it to raise `{ref['raises']}`."
        where = f"{package}.{case.module}." if style == "named" else ""
        lines.append(f"Calling `{where}{case.function}({case.args})` {got}. {want}")
    title = f"Failing tests in {package}" if style == "test_id" else f"Wrong results from {package}"
    return f"{title}\n\n" + "\n".join(lines) + "\n"
