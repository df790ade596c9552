"""The nano tier of the micro generator: tasks a few-million-parameter policy can learn to repair.

A nano task is a package of 1-3 short modules; each module holds 2-4 functions of a few lines, drawn from
SHAPES, and every function's one-line docstring states what the function computes precisely enough that
the correct code follows from the docstring alone ("Return {a} plus {b} times 3."). One function carries one
one-line bug from crr.tasks.bugs, so the code disagrees with its docstring, and the issue (a measured
failing call: "Calling `pkg.mod.fn(2, 5)` returns `-13`. I expected `17`.") names the module and the
function. A policy that copies the path from the issue, finds the function in the file it views and
rewrites the line that disagrees with the docstring solves it: repair by reading, not by memory.

Nothing can be memorised: every identifier (package, module, function, parameter and local names) is a
pseudo-word drawn per instance from a large procedural vocabulary, the constants are drawn per instance,
and the train and test splits use disjoint vocabularies: both build words from the same syllables, and a
word belongs to the split its CRC-32 parity names, so no identifier of a test instance ever appears in a
train instance, while both are made of the same pieces (tokens) as real identifiers are. (Disjoint syllable
inventories were tried first: a policy trained on one could not even copy the other's names, since their
tokens never occurred where names are copied.)

Templates built here are ordinary crr.tasks.templates.Template objects: crr.tasks.micro turns them into
tasks by the same code path as the default tier (real git repositories, real pytest runs, swebench's
parser measuring FAIL_TO_PASS / PASS_TO_PASS).
"""

from __future__ import annotations

import builtins
import keyword
import random
import zlib

from crr.tasks.bugs import FAMILIES
from crr.tasks.templates import Module, Template

# One-line bugs only: a missing branch is two or more lines to restore.
NANO_FAMILIES = tuple(f for f in FAMILIES if f != "missing_branch")
# zlib.crc32(word) % 2 of the split's words. The validation split draws from the test vocabulary (it stands in
# for the test set when choosing), its instances from their own seeds (crr.tasks.micro: the split is in every seed).
SPLIT_PARITY = {"train": 0, "test": 1, "val": 1}
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "h", "j", "w", "br", "dr",
           "gl", "kl", "pr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "", "n", "r", "l", "s", "m")
_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "test", "tests", "setup"}

# (docstring, body lines, parameters, kind of each parameter). Placeholders: {f} function, {a} {b} {xs}
# {s} {flag} parameters, {t} {c} {x} locals, {K} {M} integer constants, {w} a word.
SHAPES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "affine": ("Return {a} plus {b} times {K}.",
               ("{t} = {b} * {K}", "return {a} + {t}"), ("a:int", "b:int")),
    "difference": ("Return {a} minus {b}, or 0 when that is negative.",
                   ("{t} = {a} - {b}", "if {t} < 0:", "    return 0", "return {t}"), ("a:int", "b:int")),
    "clamp": ("Return {a}, but at most {K}.",
              ("if {a} > {K}:", "    return {K}", "return {a}"), ("a:int",)),
    "at_least": ("Return True when {a} is at least {K}.",
                 ("return {a} >= {K}",), ("a:int",)),
    "smaller": ("Return the smaller of {a} and {b}, plus {K}.",
                ("return min({a}, {b}) + {K}",), ("a:int", "b:int")),
    "count_above": ("Count the items of {xs} that are greater than {K}.",
                    ("{c} = 0", "for {x} in {xs}:", "    if {x} > {K}:", "        {c} += 1", "return {c}"),
                    ("xs:list",)),
    "shout": ("Return {s} in upper case followed by '{w}'.",
              ("return {s}.upper() + '{w}'",), ("s:str",)),
    "head": ("Return the first {K} items of {xs}.",
             ("return {xs}[:{K}]",), ("xs:list",)),
    "scale_if": ("Return {a} times {K} when {flag} is true, else {a} plus {M}.",
                 ("if {flag}:", "    return {a} * {K}", "return {a} + {M}"), ("a:int", "flag:bool")),
    "largest_or": ("Return the largest item of {xs}, or {K} when {xs} is empty.",
                   ("if not {xs}:", "    return {K}", "return max({xs})"), ("xs:list",)),
    "total_plus": ("Return the sum of the items of {xs}, each plus {K}.",
                   ("{t} = 0", "for {x} in {xs}:", "    {t} += {x} + {K}", "return {t}"), ("xs:list",)),
    "below": ("Return the items of {xs} that are less than {K}.",
              ("return [{x} for {x} in {xs} if {x} < {K}]",), ("xs:list",)),
}
N_CASES = 5


class Vocabulary:
    """Pseudo-words of one split, unique within an instance."""

    def __init__(self, split: str, rng: random.Random):
        self.parity, self.rng, self.used = SPLIT_PARITY[split], rng, set()

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            n = self.rng.randint(*syllables)
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                        for _ in range(n))
            if (zlib.crc32(w.encode()) % 2 == self.parity and w not in self.used and w not in _RESERVED
                    and len(w) <= 12):
                self.used.add(w)
                return w

    def name(self) -> str:
        """A function name: one or two words."""
        return self.word() if self.rng.random() < 0.5 else f"{self.word((1, 2))}_{self.word((1, 2))}"

    def near(self, name: str) -> str | None:
        """A look-alike of `name` (one of its words with a letter added, dropped or changed: `brami` for `bramu`)
        whose words are all of this split, or None when none of the tries is."""
        parts = name.split("_")
        for _ in range(40):
            i = self.rng.randrange(len(parts))
            w, how = parts[i], self.rng.choice(("add", "drop", "vowel"))
            if how == "add":
                w = w + self.rng.choice(("s", "a", "o", "i"))
            elif how == "drop" and len(w) > 3:
                w = w[:-1]
            else:
                j = max((k for k, ch in enumerate(w) if ch in _VOWELS), default=None)
                if j is None:
                    continue
                w = w[:j] + self.rng.choice([v for v in _VOWELS if v != w[j]]) + w[j + 1:]
            new = "_".join([*parts[:i], w, *parts[i + 1:]])
            if (new not in self.used and w not in _RESERVED and new not in _RESERVED
                    and all(zlib.crc32(p.encode()) % 2 == self.parity for p in new.split("_"))):
                self.used.add(new)
                return new
        return None


def make_function(shape: str, vocab: Vocabulary, rng: random.Random,
              name: str | None = None) -> tuple[str, str, tuple[str, ...]]:
    """(name, source, case argument sources) of one function of `shape` (called `name`, else a drawn name)."""
    doc, body, params = SHAPES[shape]
    k = rng.randint(2, 9)
    names = {"f": name or vocab.name(), "t": vocab.word((1, 2)), "c": vocab.word((1, 2)), "x": vocab.word((1, 1)),
             "K": str(k), "M": str(rng.choice([m for m in range(1, 10) if m != k])), "w": vocab.word((1, 2))}
    kinds = {}
    for p in params:
        key, kind = p.split(":")
        names[key] = vocab.word((1, 2))
        kinds[key] = kind
    lines = [f"def {names['f']}({', '.join(names[p.split(':')[0]] for p in params)}):",
             f'    """{doc.format(**names)}"""', *(f"    {line.format(**names)}" for line in body)]
    cases = []
    for _ in range(40):
        if len(cases) == N_CASES:
            break
        args = ", ".join(_value(kinds[p.split(":")[0]], k, vocab, rng) for p in params)
        if args not in cases:
            cases.append(args)
    return names["f"], "\n".join(lines) + "\n", tuple(cases)


def _value(kind: str, k: int, vocab: Vocabulary, rng: random.Random) -> str:
    """A case argument: values around the function's constant, where off-by-one bugs show."""
    if kind == "int":
        return str(rng.choice([k - 1, k, k + 1, rng.randint(-5, 15), rng.randint(0, 20)]))
    if kind == "bool":
        return rng.choice(["True", "False"])
    if kind == "str":
        return repr(vocab.rng.choice(["", "ab", "Hi", "xyz", "Ok go", "nano"]))
    n = rng.randint(0, 6)
    return "[" + ", ".join(str(rng.choice([k - 1, k, k + 1, rng.randint(0, 12)])) for _ in range(n)) + "]"


def helpers_module(name: str, functions: list[tuple[str, str, tuple[str, ...]]]) -> Module:
    """A module of `make_function` results under a one-line docstring."""
    source = f'"""{name.capitalize()} helpers."""\n\n\n' + "\n\n".join(src for _, src, _ in functions)
    return Module(name, source, {fn: cases for fn, _, cases in functions})


def nano_template(rng: random.Random, split: str) -> Template:
    """One nano package: 1-3 modules of 2-4 functions each, every name drawn from `split`'s vocabulary."""
    if split not in SPLIT_PARITY:
        raise ValueError(f"unknown split {split!r}")
    vocab = Vocabulary(split, rng)
    package = vocab.word((2, 3))
    modules = []
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        name = vocab.word((2, 3))
        functions = [make_function(shape, vocab, rng) for shape in rng.sample(sorted(SHAPES), rng.randint(2, 4))]
        modules.append(helpers_module(name, functions))
    return Template(name="nano", split=split, packages=(package,), purpose=f"use {package}'s helpers",
                    modules=tuple(modules))


def run_call(source: str, function: str, args: str) -> str:
    """`returns <repr>` or `raises <Exc>: <msg>` of one call of a generated module's function, run in-process
    (our own generated code: a few pure functions), as the curricula compute expected and observed values."""
    namespace: dict = {}
    try:
        exec(compile(source, "<nano>", "exec"), namespace)
        return f"returns {eval(f'__f({args})', {'__f': namespace[function]})!r}"
    except Exception as e:  # noqa: BLE001 - an exception is the observable behaviour
        return f"raises {type(e).__name__}: {e}"
