"""A synthetic lookup-and-repair curriculum for the warm start on the nano tier (CPU scale).

A model of a few million parameters trained from random weights learns to copy quickly, but learns to find
what to copy among distractors only when grown into it (../shared/notes/copy_curriculum.py: stuck at chance
on six lines from the start, 91 % with one, then three, then six). Repairing a nano task is that skill:
find the function the issue names in the file just viewed, find its line that disagrees with its docstring,
copy the line number and the line with the one token fixed. So before the expert's episodes, the warm start
can train on many short synthetic rows that hold only that skill, in the exact token layout of an episode
in the compact format:

    system, issue  ->  view_file(path)  ->  the file as view_file renders it
                   ->  edit_file(path, L, L, fixed line)  ->  the diff as edit_file renders it  ->  submit_patch

Rows are rendered, not played: the package is a nano template (crr.tasks.nano) with one bug from
crr.tasks.bugs, the issue is written by the micro generator's own `issue_text` from a call whose correct and
buggy results differ (computed by running the two module versions in-process: our own generated code), and
the observations come from the tools' own renderers. They teach the shape of a repair; the expert's episodes,
played in real sandboxes and kept only at reward 1, remain the warm start's data proper. `levels` grow the
search: level 0 views only the function the issue names (view_file from its def line to its last line), level 1
packages hold one module of two functions, level 2 up to three modules of up to four. Level 3 is the multi
tier's: a multi episode up to the view of its k-th bug's module, the failing function's name copied from the
issue or a failing test's id into a grep (crr.sft.locate); level 4 the same episode whole, every bug fixed, then
submit_patch.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from crr.agent.expert import from_def_line, function_at
from crr.agent.tools import ToolCall, render_diff, render_view, split_lines
from crr.policy.grammar import ToolCallGrammar
from crr.seeds import keyed_random
from crr.sft.locate import locate_conversations
from crr.sft.rows import scripted_messages, sft_row
from crr.tasks.bugs import mutants
from crr.tasks.micro import issue_text
from crr.tasks.nano import NANO_FAMILIES, nano_template, run_call
from crr.tasks.templates import Module, Template

LEVELS = (0, 1, 2, 3, 4)     # what each level draws (the module docstring)
LOCATE_LEVEL = 3             # crr.sft.locate: the multi tier's locate decisions
MULTI_REPAIR_LEVEL = 4       # crr.sft.locate, whole: its episodes through every fix to the submit
DEFAULT_LEVELS = (1, 2)      # the shipped recipes' rows



def _shrink(template: Template, rng: random.Random) -> Template:
    """Level 1: one module of two functions."""
    module = template.modules[0]
    keep = rng.sample(sorted(module.cases), 2)
    chunks = module.source.split("\n\n\n")
    body = [c for c in chunks[1:] if c.split("(")[0].removeprefix("def ") in keep]
    source = "\n\n\n".join([chunks[0], *body]).rstrip("\n") + "\n"
    return Template(template.name, template.split, template.packages, template.purpose,
                    (Module(module.name, source, {k: module.cases[k] for k in keep}),))


def repair_messages(rng: random.Random, level: int, max_turns: int, def_edit: bool = False) -> list[dict] | None:
    """One synthetic repair conversation in the compact format (None: this draw had no revealing bug); with
    `def_edit`, the edit starts at the function's def line, as the expert's `p_def_edit` episodes do."""
    template = nano_template(rng, "train")
    if level <= 1:
        template = _shrink(template, rng)
    package = template.packages[0]
    module = rng.choice(template.modules)
    family = rng.choice(NANO_FAMILIES)
    sites = mutants(module.source, family, rng)
    if not sites:
        return None
    bug = rng.choice(sites)
    case_args = list(module.cases[bug.function])
    rng.shuffle(case_args)
    for args in case_args:
        expected, observed = run_call(module.source, bug.function, args), run_call(bug.source, bug.function, args)
        if expected != observed and expected.startswith("returns"):
            break
    else:
        return None
    old, new = split_lines(bug.source), split_lines(module.source)
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    if len(old) != len(new) or len(changed) != 1:
        return None
    line = changed[0] + 1
    case = SimpleNamespace(module=module.name, function=bug.function, args=args)
    problem = issue_text(rng, package, template, case, {"value": expected[8:]}, observed, short=True)
    path = f"{package}/{module.name}.py"
    edit = ToolCall("edit_file", {"path": path, "start": line, "end": line, "replacement": new[line - 1]})
    view = {"path": path}
    if level == 0:  # only the function: the line to copy is one of a handful
        _, first, last = function_at(bug.source, line)
        view = {"path": path, "start": first, "end": last}
    calls = [(ToolCall("view_file", view), render_view(path, old, view.get("start", 1), view.get("end"))),
             (from_def_line(edit, bug.source) if def_edit else edit, render_diff(path, old, new)),
             (ToolCall("submit_patch", {}), None)]
    return scripted_messages(problem, calls, max_turns)


def curriculum_rows(grammar: ToolCallGrammar, n: int, seed: int, levels: tuple[int, ...] = DEFAULT_LEVELS,
                    max_turns: int = 8, p_def_edit: float = 0.0) -> list[dict]:
    """`n` rows (input_ids, assistant_masks, level), an equal share for each entry of `levels`, in its order
    (name a level twice for twice its share); a `p_def_edit` share of them edit from the def line (drawn only
    when asked for, so that other recipes keep their rows draw for draw)."""
    rng = keyed_random("curriculum", seed)
    rows = []
    per_level = -(-n // len(levels))
    for level in levels:
        if level in (LOCATE_LEVEL, MULTI_REPAIR_LEVEL):
            for messages in locate_conversations(rng, min(per_level, n - len(rows)), max_turns,
                                                 whole=level == MULTI_REPAIR_LEVEL):
                rows.append({**sft_row(grammar, messages, []), "level": level})
            continue
        made = 0
        while made < per_level and len(rows) < n:
            def_edit = p_def_edit > 0 and rng.random() < p_def_edit
            messages = repair_messages(rng, level, max_turns, def_edit)
            if messages is None:
                continue
            rows.append({**sft_row(grammar, messages, []), "level": level})
            made += 1
    return rows
