"""Scripted experts: the gold patch played through the five tools.

`expert_script` is the minimal one (the policy of `crr demo`): look at the tests, read the files the gold
patch touches, make the gold edits, re-run the tests, submit.

`explore_script` is the SFT expert (paper: the warm start before RL). It is steered by the gold patch but
behaves like an agent that only reads the issue and its observations: it lists the repository, runs the
suite, reproduces the issue's call, greps for the function, views the module the issue names, look-alike
`legacy.py`/`compat.py` copies and unrelated modules, sometimes makes a wrong edit first (a different
change at the right place, or the right change in the look-alike copy), notices it when the reproduction
still fails, re-views and fixes it, checks with focused tests, and submits. The exploration is what leaves
a warm-started policy room to improve: viewing decoys and erring cost turns, not reward.

The script is planned up front from the task, a seeded RNG and the files at base_commit (read from a
scratch sandbox, where candidate wrong fixes are also tried against the issue's call so that a wrong edit
is visibly wrong), so the same (task, seed, config) gives the same calls; the plan never depends on
command output that can vary (timings, paths).
"""

from __future__ import annotations

import ast
import json
import random
import re
import shlex
from dataclasses import dataclass
from difflib import SequenceMatcher
from os.path import commonprefix

from unidiff import PatchSet

from crr.agent.prompt import TOOL_SCHEMAS
from crr.agent.tools import ToolCall
from crr.errors import CRRError
from crr.sandbox.base import Sandbox
from crr.seeds import keyed_random
from crr.tasks.bugs import FAMILIES, iter_mutants
from crr.tasks.schema import Task

LOOKALIKE_MODULES = ("legacy.py", "compat.py")  # the micro generator's decoy copies of the buggy function
LIST_COMMANDS = ("git ls-files", "find . -name '*.py' -not -path './.git/*' | sort", "ls -R {package} tests")
MAX_WRONG_FIX_TRIES = 8  # candidate wrong fixes checked against the reproduction
_ORDER = {t["function"]["name"]: list(t["function"]["parameters"]["properties"]) for t in TOOL_SCHEMAS}


def gold_edits(task: Task) -> list[ToolCall]:
    """The gold patch as edit_file calls; hunks bottom-up so earlier line numbers stay valid."""
    calls = []
    for patched in PatchSet(task.patch):
        if patched.is_removed_file:
            calls.append(ToolCall("run_shell", {"command": f"rm -- {patched.path}", "timeout": 60}))
            continue
        for hunk in reversed(list(patched)):
            new_text = "".join(line.value for line in hunk if not line.is_removed)
            if patched.is_added_file or hunk.source_length == 0:
                # an insertion after line source_start (0 for a new file): an empty range start..start-1
                start, end = hunk.source_start + 1, hunk.source_start
            else:
                start, end = hunk.source_start, hunk.source_start + hunk.source_length - 1
            calls.append(ToolCall("edit_file", {"path": patched.path, "start": start, "end": end,
                                                "replacement": new_text}))
    return calls


def gold_files(task: Task) -> list[str]:
    return [p.path for p in PatchSet(task.patch) if not p.is_added_file]


def expert_script(task: Task) -> list[ToolCall]:
    """run_tests, view each gold file, the gold edits, run_tests, submit_patch."""
    views = [ToolCall("view_file", {"path": path, "start": 1, "end": 200}) for path in gold_files(task)]
    return [ToolCall("run_tests", {"test_filter": ""}), *views, *gold_edits(task),
            ToolCall("run_tests", {"test_filter": ""}), ToolCall("submit_patch", {})]


def call_json(call: ToolCall) -> str:
    """A call as the model emits it: arguments in schema order (the order the chat template renders and
    the grammar forces), json.dumps separators."""
    order = _ORDER.get(call.name, [])
    args = {k: call.arguments[k] for k in sorted(call.arguments, key=lambda k: (order.index(k) if k in order
                                                                              else len(order), k))}
    return json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False)


# ----------------------------------------------------------------------------- the exploring expert

@dataclass(frozen=True)
class ExpertConfig:
    """How much the SFT expert explores; every probability is per episode."""
    error_rate: float = 0.3        # make a wrong edit first, then notice and fix it
    max_decoy_views: int = 2       # look-alike or unrelated files viewed while localising (at most)
    p_list: float = 0.8            # list the repository first
    p_full_tests: float = 0.5      # run the whole suite before anything else
    p_reproduce: float = 0.8       # run the issue's call (when the issue shows one)
    p_grep: float = 0.6            # grep for the function's definition
    p_focused_view: float = 0.5    # after a grep, view from the function's def line, not the whole file
    p_final_suite: float = 0.3     # run the whole suite before submitting (else focused tests)
    p_line_view: float = 0.0       # view exactly the lines an edit replaces right before it (so the edit
                                   # copies them from the last observation, not from a whole file)
    p_sed: float = 0.0             # make one-line edits with `sed -i 'Ns/old/new/' path` (run_shell), which
                                   # writes only the changed fragment, not the whole line with its names
    p_def_edit: float = 0.0        # start an edit inside a function at the function's def line, so the
                                   # replacement opens with the name the issue gives and copies on from there
    p_grep_named: float = 0.0      # multi tier: grep for a bug's function even where the issue names its module,
                                   # so every issue style locates the same way (drawn only when > 0)

    def __post_init__(self) -> None:
        for name in ("error_rate", "p_list", "p_full_tests", "p_reproduce", "p_grep", "p_focused_view",
                     "p_final_suite", "p_line_view", "p_sed", "p_def_edit", "p_grep_named"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise CRRError(f"expert {name} must be between 0 and 1, got {getattr(self, name)}")
        if self.max_decoy_views < 0:
            raise CRRError(f"expert max_decoy_views must be >= 0, got {self.max_decoy_views}")


@dataclass(frozen=True)
class ExpertPlan:
    calls: list[ToolCall]
    wrong_edit: str | None   # "wrong_fix" (right place, wrong change), "lookalike" (right change, decoy copy)


@dataclass(frozen=True)
class IssueCall:
    """The call an issue reports: `from {module} import {function}` then `{call}`."""
    module: str     # dotted, e.g. textmetrics.stats
    function: str
    call: str       # e.g. average_sentence_length('')

    @property
    def path(self) -> str:
        return self.module.replace(".", "/") + ".py"


def parse_issue_call(text: str) -> IssueCall | None:
    """The reproducing call in a micro-style issue (a doctest, a print() snippet or a dotted call in
    backticks), or None when the issue shows none."""
    m = re.search(r"`(\w+(?:\.\w+)+)\.(\w+)\(([^`]*)\)`", text)
    if m:
        return IssueCall(m[1], m[2], f"{m[2]}({m[3]})")
    imp = re.search(r"from ([\w.]+) import (\w+)", text)
    if imp is None:
        return None
    fn = re.escape(imp[2])
    call = re.search(rf"^(?:>>> |print\()({fn}\(.*\))\)?$", text, re.MULTILINE)
    if call is None:
        return None
    expr = call[1]
    if call[0].startswith("print(") and expr.endswith(")") and expr.count("(") < expr.count(")"):
        expr = expr[:-1]
    return IssueCall(imp[1], imp[2], expr)


@dataclass(frozen=True)
class _Edit:
    path: str
    start: int
    end: int
    replacement: str

    def call(self) -> ToolCall:
        return ToolCall("edit_file", {"path": self.path, "start": self.start, "end": self.end,
                                      "replacement": self.replacement})

    def apply(self, text: str) -> str:
        lines = text.splitlines(keepends=True)
        return "".join(lines[:self.start - 1] + self.replacement.splitlines(keepends=True) + lines[self.end:])


def fix_edits(task: Task) -> list[ToolCall]:
    """The gold patch as minimal edits (context lines dropped), bottom-up per file; removed files as
    `rm`, added files as whole-file creations."""
    calls: list[ToolCall] = []
    for patched in PatchSet(task.patch):
        if patched.is_removed_file:
            calls.append(ToolCall("run_shell", {"command": f"rm -- {shlex.quote(patched.path)}"}))
        elif patched.is_added_file:
            text = "".join(line.value for hunk in patched for line in hunk if not line.is_removed)
            calls.append(_Edit(patched.path, 1, 0, text).call())
        else:
            calls += [_minimal_edit(patched.path, hunk).call() for hunk in reversed(list(patched))]
    return calls


def _minimal_edit(path: str, hunk) -> _Edit:
    lines = list(hunk)
    changed = [i for i, line in enumerate(lines) if not line.is_context]
    first, last = changed[0], changed[-1]
    before = [line for line in lines[:first] if not line.is_added]
    start = before[-1].source_line_no + 1 if before else hunk.source_start
    removed = [line for line in lines[first:last + 1] if not line.is_added]
    return _Edit(path, start, start + len(removed) - 1,
                 "".join(line.value for line in lines[first:last + 1] if not line.is_removed))


class _Planner:
    """Plans one exploring episode; `plan()` returns the calls."""

    def __init__(self, task: Task, sandbox: Sandbox, rng: random.Random, config: ExpertConfig):
        self.task, self.sandbox, self.rng, self.cfg = task, sandbox, rng, config
        self.files = sorted(sandbox.exec("git ls-files", timeout=60).output.split())
        self.issue = parse_issue_call(task.problem_statement)
        if self.issue is not None and self.issue.path not in self.files:
            self.issue = None
        self.fixes = fix_edits(task)
        if not self.fixes:
            raise CRRError(f"task {task.instance_id} has an empty gold patch; the expert needs one to follow")
        self.texts: dict[str, str] = {}
        self.calls: list[ToolCall] = []
        self.seen: set[str] = set()   # file names the agent has seen in observations (or the issue)
        # drawn only when asked for, so that recipes without line views keep their episodes draw for draw
        self.line_view = config.p_line_view > 0 and self.chance(config.p_line_view)
        self.sed = config.p_sed > 0 and self.chance(config.p_sed)
        self.def_edit = config.p_def_edit > 0 and self.chance(config.p_def_edit)
        self.now: dict[str, str] = {}  # files as this episode's edits so far left them (sed episodes)

    def text(self, path: str) -> str:
        if path not in self.texts:
            self.texts[path] = self.sandbox.read_file(path).decode("utf-8", errors="replace")
        return self.texts[path]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def add(self, name: str, **arguments) -> None:
        self.calls.append(ToolCall(name, arguments))

    def edit(self, call: ToolCall) -> None:
        """An edit_file call, after a view of exactly the lines it replaces when this episode does those; a
        one-line edit becomes a `sed` substitution in the episodes that edit that way; in def-edit episodes
        an edit inside a function starts at its def line."""
        a = call.arguments
        if call.name != "edit_file" or a["path"] not in self.files:
            self.calls.append(call)
            return
        if self.def_edit:
            call = from_def_line(call, self.now.get(a["path"], self.text(a["path"])))
            a = call.arguments
        if self.line_view and a["end"] >= a["start"]:
            self.add("view_file", path=a["path"], start=a["start"], end=a["end"])
        if not self.sed:
            self.calls.append(call)
            return
        before = self.now.get(a["path"], self.text(a["path"]))
        lines = before.splitlines(keepends=True)
        one_line = a["start"] == a["end"] <= len(lines) and a["replacement"].count("\n") <= 1
        command = sed_command(a["path"], a["start"], lines[a["start"] - 1], a["replacement"]) if one_line else None
        self.calls.append(call if command is None else ToolCall("run_shell", {"command": command}))
        self.now[a["path"]] = _Edit(**a).apply(before)

    # --- pieces of behaviour

    def repro_command(self) -> str:
        code = f"from {self.issue.module} import {self.issue.function}; print({self.issue.call})"
        quoted = f'"{code}"' if not set(code) & set('"$`\\!') else shlex.quote(code)
        return f"python -c {quoted}"

    def reproduce(self) -> None:
        self.add("run_shell", command=self.repro_command())

    def repro_output(self, path: str, text: str) -> str:
        """What the reproduction prints with `path` holding `text` (tried in the scratch sandbox)."""
        self.sandbox.write_file(path, text.encode())
        try:
            return self.sandbox.exec(self.repro_command(), timeout=10).output
        finally:
            self.sandbox.write_file(path, self.text(path).encode())

    def focused_tests(self, path: str, function: str | None) -> None:
        """A selector that runs some tests: the module's test file, or the tests named after the function."""
        test_file = f"tests/test_{path.rsplit('/', 1)[-1]}"
        choices = [test_file] if test_file in self.files else []
        if function and any(f"def test_{function}" in self.text(p) for p in self.files
                            if p.startswith("tests/") and p.endswith(".py")):
            choices.append(f"-k {function}")
            if test_file in choices and f"def test_{function}" in self.text(test_file):
                choices.append(f"{test_file} -k {function}")
        self.add("run_tests", test_filter=self.rng.choice(choices) if choices else "")

    def view(self, path: str, start: int | None = None) -> None:
        """The whole file, or from line `start` on (a line number the agent saw: a grep hit, a def)."""
        if start is None:
            self.add("view_file", path=path)
        else:
            self.add("view_file", path=path, start=start)
        self.seen.add(path)

    def grep(self, function: str, where: str) -> None:
        self.add("run_shell", command=f"grep -rn 'def {function}(' {where}")
        hits = [p for p in self.files if p.startswith(where.rstrip("/") + "/") or p == where]
        self.seen.update(p for p in hits if f"def {function}(" in self.text(p))

    def lookalike(self, path: str, function: str) -> str | None:
        """A decoy module holding a copy of `function` identical to the one in `path`."""
        package = path.rsplit("/", 1)[0] if "/" in path else ""
        mine = _function_source(self.text(path), function)
        if mine is None:
            return None
        for name in LOOKALIKE_MODULES:
            other = f"{package}/{name}" if package else name
            if other in self.files and _function_source(self.text(other), function) == mine:
                return other
        return None

    # --- the episode

    def plan(self) -> ExpertPlan:
        edits = [c for c in self.fixes if c.name == "edit_file" and c.arguments["path"] in self.files]
        target = edits[0].arguments["path"] if edits else self.fixes[0].arguments.get("path", "")
        package = target.split("/", 1)[0] if "/" in target else "."
        located = function_at(self.text(target), edits[0].arguments["start"]) if edits else None
        function = located[0] if located else None
        if self.issue is not None:
            self.seen.add(self.issue.path)

        # Orient: list the files, run the suite, reproduce the issue.
        if self.chance(self.cfg.p_list):
            self.add("run_shell", command=self.rng.choice(LIST_COMMANDS).format(package=package))
            self.seen.update(self.files)
        if self.chance(self.cfg.p_full_tests):
            self.add("run_tests", test_filter="")
        reproducible = self.issue is not None and self.chance(self.cfg.p_reproduce)
        if reproducible:
            self.reproduce()

        # Localise: the module the issue names, a grep, decoys, then the file to fix.
        if self.issue is not None and self.issue.path != target:
            self.view(self.issue.path)
        grepped = function is not None and (self.chance(self.cfg.p_grep) or
                                            (self.issue is not None and self.issue.path != target))
        if grepped:
            self.grep(function, package)
        lookalike = self.lookalike(target, function) if function else None
        decoys = [p for p in self.files if p in self.seen and p.endswith(".py") and p != target
                  and not p.startswith("tests/") and not p.endswith("__init__.py")
                  and (self.issue is None or p != self.issue.path)]
        self.rng.shuffle(decoys)
        if lookalike in decoys:  # the look-alike copy is the tempting one: view it first when seen
            decoys.remove(lookalike)
            decoys.insert(0, lookalike)
        n_decoys = min(self.cfg.max_decoy_views, len(decoys))
        for path in decoys[:self.rng.randint(min(1, n_decoys), n_decoys)]:
            self.view(path)
        focus = located[1] if grepped and located and self.chance(self.cfg.p_focused_view) else None
        for path in dict.fromkeys(c.arguments["path"] for c in edits):
            self.view(path, focus if path == target else None)

        # Fix, perhaps after a wrong edit that the reproduction (or the tests) shows to be wrong.
        erred = self.chance(self.cfg.error_rate) and edits and self.wrong_edit(edits[0], lookalike, function)
        for call in self.fixes:
            if erred and call is edits[0]:
                self.check(target, function, reproducible)
                self.undo_and_fix(call, erred, function)
            else:
                self.edit(call)

        # Verify (the system prompt asks for the test suite before submission) and submit.
        if reproducible:
            self.reproduce()
        if self.chance(self.cfg.p_final_suite):
            self.add("run_tests", test_filter="")
        else:
            self.focused_tests(target, function)
        self.add("submit_patch")
        kind = None if not erred else "wrong_fix" if erred.path == target else "lookalike"
        return ExpertPlan(self.calls, kind)

    def check(self, path: str, function: str | None, reproducible: bool) -> None:
        if reproducible:
            self.reproduce()
        else:
            self.focused_tests(path, function)

    def wrong_edit(self, fix: ToolCall, lookalike: str | None, function: str | None) -> _Edit | None:
        """Play a plausible wrong edit before `fix`; returns it (None if the task offers none)."""
        edit = _Edit(**fix.arguments)
        choices = []
        wrong = self.wrong_fix(edit)
        if wrong is not None:
            choices.append(wrong)
        if lookalike is not None:
            offset = (_function_line(self.text(lookalike), function)
                      - _function_line(self.text(edit.path), function))
            choices.append(_Edit(lookalike, edit.start + offset, edit.end + offset, edit.replacement))
        if not choices:
            return None
        chosen = self.rng.choice(choices)
        if chosen.path != edit.path and chosen.path not in self.seen_views():
            self.view(chosen.path)
        self.edit(chosen.call())
        return chosen

    def seen_views(self) -> set[str]:
        return {c.arguments["path"] for c in self.calls if c.name == "view_file"}

    def wrong_fix(self, edit: _Edit) -> _Edit | None:
        """The fix's lines changed by another bug-family mutation: the right place, the wrong change."""
        new = edit.replacement.splitlines(keepends=True)
        if not new or self.issue is None:  # without the issue's call there is no telling a wrong fix apart
            return None
        buggy = self.text(edit.path)
        fixed = edit.apply(buggy)
        fixed_lines = fixed.splitlines(keepends=True)
        lo, hi = edit.start - 1, edit.start - 1 + len(new)
        right = self.repro_output(edit.path, fixed)
        families = sorted(FAMILIES)
        self.rng.shuffle(families)
        tried = 0
        for family in families:
            for mutant in iter_mutants(fixed, family, random.Random(self.rng.random())):
                lines = mutant.source.splitlines(keepends=True)
                if (len(lines) == len(fixed_lines) and mutant.source != buggy
                        and lines[:lo] == fixed_lines[:lo] and lines[hi:] == fixed_lines[hi:]):
                    # wrong only if the reproduction shows it (an equivalent rewrite would pass the tests)
                    if self.repro_output(edit.path, mutant.source) != right:
                        return _Edit(edit.path, edit.start, edit.end, "".join(lines[lo:hi]))
                    tried += 1
                    if tried >= MAX_WRONG_FIX_TRIES:
                        return None
        return None

    def undo_and_fix(self, fix: ToolCall, wrong: _Edit, function: str | None) -> None:
        edit = _Edit(**fix.arguments)
        n_wrong = len(wrong.replacement.splitlines())
        if wrong.path == edit.path:  # re-read the edited lines, then put the right change over the wrong one
            located = function_at(self.text(edit.path), edit.start)
            self.view(edit.path, located[1] if located else None)
            self.edit(_Edit(edit.path, edit.start, edit.start + n_wrong - 1, edit.replacement).call())
            return
        # The fix went into the look-alike copy: find the real definition, fix it there, restore the copy.
        if function is not None:
            self.grep(function, edit.path.rsplit("/", 1)[0] if "/" in edit.path else ".")
        if edit.path not in self.seen_views():
            self.view(edit.path)
        self.edit(fix)
        original = "".join(self.text(wrong.path).splitlines(keepends=True)[wrong.start - 1:wrong.end])
        self.edit(_Edit(wrong.path, wrong.start, wrong.start + n_wrong - 1, original).call())


def function_at(text: str, line: int) -> tuple[str, int, int] | None:
    """(name, def line, last line) of the top-level function of `text` holding `line` (or just after it)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for node in tree.body:
        if _is_function(node) and node.lineno <= line <= node.end_lineno + 1:
            return node.name, node.lineno, node.end_lineno
    return None


def from_def_line(call: ToolCall, text: str) -> ToolCall:
    """An edit_file call inside a top-level function of `text` widened to start at the function's def line
    (the lines before the edit rewritten unchanged); other edits as they are."""
    a = call.arguments
    located = function_at(text, a["start"])
    if located is None or not located[1] < a["start"] <= a["end"] <= located[2]:
        return call
    head = "".join(text.splitlines(keepends=True)[located[1] - 1:a["start"] - 1])
    return ToolCall("edit_file", {**a, "start": located[1], "replacement": head + a["replacement"]})


_IDENTIFIER = re.compile(r"\w")
_SED_PATTERN_SPECIAL = set("\\.[]*^$/")   # characters a basic regular expression reads as syntax
_SED_REPLACEMENT_SPECIAL = set("\\&/")
SED_EDIT = re.compile(r"sed -i '(?P<line>\d+)s/(?P<old>(?:[^/\\]|\\.)*)/(?P<new>(?:[^/\\]|\\.)*)/'"
                      r" (?P<path>\S+)")


def changed_span(old: str, new: str) -> tuple[int, int]:
    """(length of the common prefix, length of the common suffix after it) of two strings."""
    i = len(commonprefix([old, new]))
    return i, len(commonprefix([old[i:][::-1], new[i:][::-1]]))


def sed_command(path: str, line: int, old: str, new: str) -> str | None:
    """`sed -i 'LINEs/OLD/NEW/' PATH` turning line `line` from `old` into `new` (each one line), or None where
    no such command is plain to write (a fragment holding a quote or a tab, no change, a path needing quotes).

    The fragment is the shortest change (common prefix and suffix removed) widened to whole words, so the
    substitution names the operator or constant that changes, not the names around it; it is widened further
    until its first occurrence in the line is the changed one (sed replaces the first match)."""
    old, new = old.rstrip("\n"), new.rstrip("\n")
    if old == new or shlex.quote(path) != path:
        return None
    i, j = changed_span(old, new)
    lo, hi = i, len(old) - j  # old[lo:hi] becomes new[lo:len(new) - j]

    def word_cut(a: str, b: str) -> bool:
        return bool(_IDENTIFIER.match(a) and _IDENTIFIER.match(b))

    while True:
        if lo > 0 and (lo == hi or word_cut(old[lo - 1], old[lo])):
            lo -= 1
        elif hi < len(old) and (lo == hi or word_cut(old[hi - 1], old[hi])):
            hi += 1
        elif old.find(old[lo:hi]) != lo and lo > 0:
            lo -= 1
        else:
            break
    before, after = old[lo:hi], new[lo:len(new) - (len(old) - hi)]
    if not before or old.find(before) != lo or set(before + after) & set("'\t"):
        return None
    pattern = "".join("\\" + c if c in _SED_PATTERN_SPECIAL else c for c in before)
    replacement = "".join("\\" + c if c in _SED_REPLACEMENT_SPECIAL else c for c in after)
    return f"sed -i '{line}s/{pattern}/{replacement}/' {path}"


def parse_sed(command: str) -> tuple[int, str, str, str] | None:
    """(line, OLD, NEW, path) of a command `sed_command` writes, OLD and NEW unescaped; None for any other."""
    m = SED_EDIT.fullmatch(command)
    if m is None:
        return None
    return int(m["line"]), re.sub(r"\\(.)", r"\1", m["old"]), re.sub(r"\\(.)", r"\1", m["new"]), m["path"]


def _function_source(text: str, name: str | None) -> str | None:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    node = next((n for n in tree.body if _is_function(n) and n.name == name), None)
    return None if node is None else ast.get_source_segment(text, node)


def _function_line(text: str, name: str) -> int:
    tree = ast.parse(text)
    return next(n.lineno for n in tree.body if _is_function(n) and n.name == name)


def _is_function(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))


# ----------------------------------------------------------------------------- the multi tier's expert

MULTI_MAX_DECISIONS = 12  # the multi expert's horizon: extras (checks, look-alike views, wrong fixes) fit in it
MULTI_P_LOOKALIKE = 0.5   # per bug: view its module's look-alike first (when the config allows decoy views)
MULTI_P_CHECK = 0.5       # per fix but the last: run the tests to see what is still broken


class _MultiPlanner(_Planner):
    """Plans a multi-tier episode (crr.tasks.multi: 1-3 bugs in different modules, issues by style): run the
    tests, then per bug find the module (named: the issue's path, or with `p_grep_named` a grep as the other
    styles; symptom and test_id: a grep for the function, then the module from its def line), view it and fix
    it; run the tests and submit. Within MULTI_MAX_DECISIONS, some episodes also view a look-alike module first,
    check with the tests between fixes, or make a wrong fix that the tests show to be wrong and then repair it."""

    def plan(self) -> ExpertPlan:
        meta = self.task.metadata
        style, package = meta["issue_style"], meta["package"]
        edits = {c.arguments["path"]: c for c in self.fixes}
        text = self.task.problem_statement
        bugs = sorted(meta["bugs"], key=lambda b: text.find(b["test"] if style == "test_id" else f"{b['function']}("))
        grep = style != "named" or (self.cfg.p_grep_named > 0 and self.chance(self.cfg.p_grep_named))
        per_bug = 3 if grep else 2
        spare = MULTI_MAX_DECISIONS - (3 + per_bug * len(bugs))  # + the first and last run_tests, the submit
        wrong_at = self.rng.randrange(len(bugs)) if spare >= 2 and self.chance(self.cfg.error_rate) else None
        if wrong_at is not None:
            spare -= 2
        self.add("run_tests", test_filter="")
        erred = None
        for i, bug in enumerate(bugs):
            path, function = bug["file"], bug["function"]
            lookalike = self.multi_lookalike(path)
            if lookalike is not None and spare >= 1 and self.cfg.max_decoy_views and self.chance(MULTI_P_LOOKALIKE):
                self.view(lookalike)
                spare -= 1
            if not grep:
                self.view(path)
            else:
                self.grep(function, package)
                focus = self.chance(self.cfg.p_focused_view)
                self.view(path, _function_line(self.text(path), function) if focus else None)
            fix = edits[path]
            wrong = self.test_wrong_fix(_Edit(**fix.arguments), bug["test"]) if i == wrong_at else None
            if wrong is not None:
                erred = "wrong_fix"
                self.edit(wrong.call())
                self.add("run_tests", test_filter=bug["test"])
                self.edit(_Edit(path, wrong.start, wrong.start + len(wrong.replacement.splitlines()) - 1,
                                fix.arguments["replacement"]).call())
            else:
                if i == wrong_at:
                    spare += 2
                self.edit(fix)
            if i < len(bugs) - 1 and spare >= 1 and self.chance(MULTI_P_CHECK):
                self.add("run_tests", test_filter="")
                spare -= 1
        self.add("run_tests", test_filter="")
        self.add("submit_patch")
        return ExpertPlan(self.calls, erred)

    def multi_lookalike(self, path: str) -> str | None:
        """The distractor module whose name is nearest `path`'s (one edit or two away), if any."""
        near = [(SequenceMatcher(None, path, d).ratio(), d) for d in self.task.metadata.get("distractors", [])]
        near = [(r, d) for r, d in near if r >= 0.8]
        return max(near)[1] if near else None

    def test_wrong_fix(self, edit: _Edit, test_id: str) -> _Edit | None:
        """The fix's lines changed by another bug-family mutation that the bug's visible test still fails."""
        buggy = self.text(edit.path)
        fixed_lines = edit.apply(buggy).splitlines(keepends=True)
        lo, hi = edit.start - 1, edit.start - 1 + len(edit.replacement.splitlines())
        families = sorted(FAMILIES)
        self.rng.shuffle(families)
        tried = 0
        for family in families:
            for mutant in iter_mutants("".join(fixed_lines), family, random.Random(self.rng.random())):
                lines = mutant.source.splitlines(keepends=True)
                if (len(lines) != len(fixed_lines) or mutant.source == buggy or lines[:lo] != fixed_lines[:lo]
                        or lines[hi:] != fixed_lines[hi:]):
                    continue
                self.sandbox.write_file(edit.path, mutant.source.encode())
                try:
                    failed = self.sandbox.exec(f"python -m pytest -q -p no:cacheprovider {shlex.quote(test_id)}",
                                               timeout=60).exit_code != 0
                finally:
                    self.sandbox.write_file(edit.path, buggy.encode())
                if failed:
                    return _Edit(edit.path, edit.start, edit.end, "".join(lines[lo:hi]))
                tried += 1
                if tried >= MAX_WRONG_FIX_TRIES:
                    return None
        return None


def explore_script(task: Task, sandbox: Sandbox, seed: int, config: ExpertConfig | None = None) -> ExpertPlan:
    """The exploring expert's calls for one episode of `task` (the multi tier's own plan for its tasks).
    `sandbox` is scratch at base_commit: the plan reads its files and tries candidate wrong fixes in it
    (restoring each file). Deterministic in (task, seed, config)."""
    rng = keyed_random("expert", seed, task.instance_id)
    planner = _MultiPlanner if task.metadata.get("tier") == "multi" else _Planner
    return planner(task, sandbox, rng, config or ExpertConfig()).plan()
