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
  failing cases are held out), so `run_tests` shows what is still broken after each edit, in pytest's short
  summary (`RUN_TESTS_CMD`).

Each task's (bugs, issue) pair comes from a seed-shuffled cycle over the knobs' product, so a set holds the
settings in equal shares; both are recorded in the row's metadata with the distractor count and every bug.
This module defines the tier (knobs, packages, issue text); crr.tasks.micro builds its rows on the path of the
other tiers: real git repositories, real pytest runs before and after the gold patch, swebench's parser
measuring FAIL_TO_PASS / PASS_TO_PASS.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from crr.errors import CRRError
from crr.seeds import keyed_random
from crr.tasks.nano import SHAPES, Vocabulary, helpers_module, make_function
from crr.tasks.templates import Template

ISSUE_STYLES = ("named", "symptom", "test_id")
BUG_COUNTS = (1, 2, 3)
MAX_CORE_MODULES = 3
SITES_PER_BUG = 6  # candidate mutants probed per buggy module
# The runner the agent's run_tests calls on a multi task: the progress line and the failing ids with their
# assertions ("FAILED tests/test_kelo.py::test_bramu_1 - assert 3 == 2"), without the session header or one
# PASSED line per test. The verifier keeps `test_cmd` (-rA, which swebench's parser reads). On a 64-84 test
# package -rA printed 1,700-2,500 tokens a run, most of a multi episode, against 70-150 for this
# (docs/multi-tier.md, "third attempt").
RUN_TESTS_CMD = "python -m pytest -q --tb=no -rf -p no:cacheprovider"


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
        keyed_random("multi", seed, split, "order").shuffle(combos)
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
class Symptom:
    """What one bug shows: its visible failing test's call, the expected outcome and the observed one."""
    module: str
    function: str
    args: str
    reference: dict   # {"value": repr} or {"raises": name}, as crr.tasks.probe computes it
    observed: str     # "returns <repr>" or "raises <Exc>: <msg>"
    test: str         # the failing test's node id


def multi_issue(package: str, symptoms: list[Symptom], style: str, rng: random.Random) -> str:
    """The issue: one line per bug, in a shuffled order, at the detail `style` allows."""
    lines = []
    for s in rng.sample(symptoms, len(symptoms)):
        if style == "test_id":
            lines.append(f"`{s.test}` fails.")
            continue
        raised = s.observed.startswith("raises ")
        got = f"raises `{s.observed[7:]}`" if raised else f"returns `{s.observed[8:]}`"
        want = (f"I expected `{s.reference['value']}`." if "value" in s.reference
                else f"I expected it to raise `{s.reference['raises']}`.")
        where = f"{package}.{s.module}." if style == "named" else ""
        lines.append(f"Calling `{where}{s.function}({s.args})` {got}. {want}")
    title = f"Failing tests in {package}" if style == "test_id" else f"Wrong results from {package}"
    return f"{title}\n\n" + "\n".join(lines) + "\n"
