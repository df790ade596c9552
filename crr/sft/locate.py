"""The curriculum's multi levels: the multi tier's locate decisions (level 3) and whole episodes (level 4).

The fourth multi warm start (docs/multi-tier.md) locates as the expert does (run the tests, grep for the
failing function's def, view the module the grep names) but copies the function's name wrongly in 113 of 124
greps, most often its first letter (`bogon` for `wogon`, `prigu` for `drigu`): its 512 expert episodes show
1,022 such copies, of 511 names. A row of this level is a multi-tier episode up to the view of
its k-th bug's module, on a package of fresh names each time, so thousands of rows show thousands of copies:

    system, issue -> run_tests -> FAILED lines
      per bug before k: grep 'def fn(' pkg -> hit -> view_file(hit's path) -> module -> edit_file(fix) -> diff
      bug k:            grep 'def fn(' pkg -> hit -> view_file(hit's path)

Level 4 plays the same episode whole: every bug located and fixed in the issue's order, then submit_patch. The
sixth multi warm start (docs/multi-tier.md) greps the right name in half its greps, but 21 of its 32 greedy
multi-val episodes end with a regression: the replacement line is not the viewed line with one token fixed
but a line spliced from elsewhere in a long context, where its 512 expert episodes hold about a thousand
edits. Level 4's rows hold every bug's edit at the lengths the tier's episodes have.

Packages, bugs and issues come from the multi tier's own generator pieces (crr.tasks.multi's template and
issue text, crr.tasks.micro's test files, crr.tasks.bugs' mutants); expected and observed values from running
our own generated functions in-process, as the nano curriculum does. The observations are real: the package is
written to a temporary folder where `run_tests`' command (the tier's RUN_TESTS_CMD) and the grep run, and views
and diffs come from the tools' own renderers. Bugs are taken in the issue's order, as the expert takes them.
"""

from __future__ import annotations

import ast
import difflib
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from crr.agent.tools import ToolCall, command_observation, render_diff, render_view, split_lines
from crr.sandbox.base import ExecResult
from crr.sft.rows import scripted_messages
from crr.tasks.bugs import mutants
from crr.tasks.micro import _Case, _package_files, _render, _test_files
from crr.tasks.multi import (
    ISSUE_STYLES,
    MAX_CORE_MODULES,
    RUN_TESTS_CMD,
    Symptom,
    multi_issue,
    multi_template,
)
from crr.tasks.nano import NANO_FAMILIES, run_call

P_FOCUSED_VIEW = 0.2   # the multi recipes' expert: view from the def line the grep showed, else the whole file
TIMEOUT_S = 60


def _outcome(source: str, function: str, args: str) -> dict:
    """A call's reference as crr.tasks.probe records it: {"value": repr} or {"raises": name}."""
    observed = run_call(source, function, args)
    return {"value": observed[8:]} if observed.startswith("returns ") else {"raises": observed[7:].split(":")[0]}


def _shell(root: Path, command: str) -> str:
    """A command's observation as run_shell / run_tests render it (the tier's `python` is this interpreter), in
    a fixed environment so that a row does not depend on the caller's (COLUMNS, PYTEST_ADDOPTS, ...)."""
    out = subprocess.run(command.replace("python -m", f"{sys.executable} -m", 1), shell=True, cwd=root,
                         capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                         env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"})
    return command_observation(ExecResult(out.returncode, out.stdout + out.stderr), TIMEOUT_S).text


def locate_calls(rng: random.Random, split: str = "train",
                 whole: bool = False) -> tuple[str, list[tuple[ToolCall, str | None]]] | None:
    """One draw: the issue and the calls with their observations, the last call's observation None (None: the
    draw had a bug without two revealing cases; the caller draws again). `split`'s vocabulary names everything
    (a probe of held-out names draws "val"). `whole` (level 4): the episode goes on through every bug's fix
    to submit_patch."""
    n_bugs, style = rng.choice((1, 2, 3)), rng.choice(ISSUE_STYLES)
    template, core = multi_template(rng, split, rng.randint(n_bugs, MAX_CORE_MODULES), rng.randint(0, 2))
    package, modules = template.packages[0], list(template.modules)
    cases = [_Case(m.name, fn, args, m.name in core) for m in modules for fn, arg_list in m.cases.items()
             for args in arg_list]
    reference = [_outcome(next(m.source for m in modules if m.name == c.module), c.function, c.args) for c in cases]
    if any("value" in r and not _literal(r["value"]) for r in reference):
        return None
    bugs, held_out = [], set()
    for module in rng.sample([m for m in modules if m.name in core], n_bugs):
        families = list(NANO_FAMILIES)
        rng.shuffle(families)
        sites = [mu for family in families for mu in mutants(module.source, family, rng)]
        rng.shuffle(sites)
        for mu in sites[:6]:
            old, new = split_lines(mu.source), split_lines(module.source)
            mine = [i for i, c in enumerate(cases) if c.module == module.name and c.function == mu.function]
            revealing = [i for i in mine if _outcome(mu.source, mu.function, cases[i].args) != reference[i]]
            if len(old) == len(new) and len(revealing) >= 2:
                break
        else:
            return None
        shown = rng.choice(revealing[:3])
        held_out |= set(revealing) - {shown}
        bugs.append((module, mu, shown, run_call(mu.source, mu.function, cases[shown].args)))
    tests, test_ids = _test_files(package, cases, reference, held_out, [])
    issue = multi_issue(package, [Symptom(m.name, mu.function, cases[shown].args, reference[shown], observed,
                                          test_ids[shown]) for m, mu, shown, observed in bugs], style, rng)
    order = sorted(bugs, key=lambda b: issue.find(test_ids[b[2]] if style == "test_id" else f"{b[1].function}("))
    files = {**_package_files(package, template, modules),
             **{f"{package}/{m.name}.py": mu.source for m, mu, _, _ in bugs},
             **{f"tests/test_{t.module}.py": _render(t, held_out=False) for t in tests.values()}}
    with tempfile.TemporaryDirectory(prefix="crr-locate-") as tmp:
        root = Path(tmp)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        calls = [(ToolCall("run_tests", {"test_filter": ""}), _shell(root, RUN_TESTS_CMD))]
        k = rng.randrange(len(order))  # drawn at level 4 too: a seed draws the same package, bugs and issue
        if whole:
            k = len(order) - 1
        for i, (module, mu, _, _) in enumerate(order[:k + 1]):
            path = f"{package}/{module.name}.py"
            grep = f"grep -rn 'def {mu.function}(' {package}"
            calls.append((ToolCall("run_shell", {"command": grep}), _shell(root, grep)))
            old, new = split_lines(mu.source), split_lines(module.source)
            start = next(n for n, line in enumerate(old, 1) if line.startswith(f"def {mu.function}("))
            view = {"path": path, "start": start} if rng.random() < P_FOCUSED_VIEW else {"path": path}
            if i == k and not whole:
                calls.append((ToolCall("view_file", view), None))
                break
            calls.append((ToolCall("view_file", view), render_view(path, old, view.get("start", 1))))
            (_, a, b, c, d), = [op for op in difflib.SequenceMatcher(None, old, new).get_opcodes() if op[0] != "equal"]
            edit = ToolCall("edit_file", {"path": path, "start": a + 1, "end": b, "replacement": "".join(new[c:d])})
            calls.append((edit, render_diff(path, old, new)))
    if whole:
        calls.append((ToolCall("submit_patch", {}), None))
    return issue, calls


def _literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    return True


def locate_conversations(rng: random.Random, n: int, max_turns: int, workers: int = 2,
                         whole: bool = False) -> list[list[dict]]:
    """`n` locate rows' conversations in the compact format (`whole`: level 4's, through every fix to the
    submit), each drawn from its own seed (drawn from `rng`); `workers` at a time, since a row waits on its
    pytest run. Draws without a usable bug are skipped."""
    out: list[list[dict]] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="crr-locate") as pool:
        while len(out) < n:
            seeds = [rng.getrandbits(64) for _ in range(n - len(out))]
            drawn = pool.map(lambda seed: locate_calls(random.Random(seed), whole=whole), seeds)
            out += [scripted_messages(*d, max_turns) for d in drawn if d is not None]
    return out[:n]
