"""Where an evaluation's edits go wrong on a micro/nano task set: per episode, whether the policy viewed exactly
one line before editing (and whether it was the gold line), edited the gold file and line (an edit whose range
holds it: one line, or from the def line as the expert's p_def_edit episodes do), and wrote the gold replacement
line exactly. An edit is an edit_file call or a one-line `sed -i 'Ns/OLD/NEW/' PATH` (run_shell), whose result
on the gold line is that line with its first OLD replaced. Used for issue 11's warm-start attempts.

    .venv/bin/python research/edit_stats.py EVAL_RUN_DIR [--tasks nano-test]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from crr.agent.expert import changed_span, parse_sed
from crr.tasks.loaders import load_tasks


def gold_edit(patch: str) -> tuple[str, int, str, str]:
    """(path, line number, old line, new line) of a one-line gold patch."""
    path = re.search(r"^\+\+\+ b/(\S+)", patch, re.M)[1]
    line = int(re.search(r"^@@ -(\d+)", patch, re.M)[1])
    for text in patch.split("@@", 2)[2].splitlines()[1:]:
        if text.startswith("-"):
            break
        line += 1
    old = next(t[1:] for t in patch.splitlines() if t.startswith("-") and not t.startswith("---"))
    new = next(t[1:] for t in patch.splitlines() if t.startswith("+") and not t.startswith("+++"))
    return path, line, old, new


def parsed(action: str) -> dict | None:
    """A step's call, None where the action was no call (cut off at max_new_tokens)."""
    try:
        return json.loads(action)
    except json.JSONDecodeError:
        return None


def carries_fix(old: str, new: str, written: str) -> bool:
    """Whether a rewritten line holds the gold change (its changed characters with one neighbour on each side)
    and not the bug's, whatever it did to the rest of the line (names miscopied, say)."""
    i, j = changed_span(old, new)
    return (new[max(0, i - 1):len(new) - j + 1] in written) and (old[max(0, i - 1):len(old) - j + 1] not in written)


def as_edit(call: dict, gold_line: int, old: str) -> dict | None:
    """An edit_file call's arguments, or a sed substitution's as edit_file arguments (its replacement known
    only on the gold line, the only line these figures compare)."""
    if call["name"] == "edit_file":
        return call["arguments"]
    sed = parse_sed(call["arguments"].get("command", "")) if call["name"] == "run_shell" else None
    if sed is None:
        return None
    line, pattern, replacement, path = sed
    new = old.replace(pattern, replacement, 1) if line == gold_line else None
    return {"path": path, "start": line, "end": line, "replacement": new}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a crr eval run directory")
    ap.add_argument("--tasks", default="nano-test")
    args = ap.parse_args()
    gold = {t.instance_id: gold_edit(t.patch) for t in load_tasks(args.tasks)}
    rewards = {(r["instance_id"], r["sample"]): r["reward"]
               for r in map(json.loads, (args.run / "results.jsonl").read_text().splitlines())}
    c = Counter({k: 0 for k in ("episodes", "solved", "line view", "line view of the gold line", "no edit",
                                "edit of the gold file", "edit of the gold line", "... carrying the gold change",
                                "... the gold line exactly")})
    for r in map(json.loads, (args.run / "transcripts.jsonl").read_text().splitlines()):
        path, line, old, new = gold[r["instance_id"]]
        calls = [call for s in r["steps"] if (call := parsed(s["action"]))]
        views = [a["arguments"] for a in calls if a["name"] == "view_file" and "end" in a["arguments"]]
        edits = [e for a in calls if (e := as_edit(a, line, old))]
        c["episodes"] += 1
        c["solved"] += rewards[(r["instance_id"], r["sample"])] == 1
        c["line view"] += bool(views)
        c["line view of the gold line"] += any(v.get("path") == path and v.get("start") == line for v in views)
        if not edits:
            c["no edit"] += 1
            continue
        last = edits[-1]
        c["edit of the gold file"] += last.get("path") == path
        start, end = last.get("start", 0), last.get("end", -1)
        on_gold_line = last.get("path") == path and start <= line <= end
        c["edit of the gold line"] += on_gold_line
        if on_gold_line:
            lines = (last.get("replacement") or "").split("\n")  # the gold line's place in the replaced range
            written = lines[line - start] if line - start < len(lines) else ""
            c["... carrying the gold change"] += carries_fix(old, new, written)
            c["... the gold line exactly"] += written == new
    print(json.dumps(dict(c)))


if __name__ == "__main__":
    main()
