"""Where an evaluation's edits go wrong on a micro/nano task set: per episode, whether the policy viewed exactly
one line before editing (and whether it was the gold line), edited the gold file and line, and wrote the gold
replacement line exactly. Used for issue 11's warm-start attempts.

    .venv/bin/python scripts/edit_stats.py EVAL_RUN_DIR [--tasks nano-test]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from crr.tasks.loaders import load_tasks


def gold_edit(patch: str) -> tuple[str, int, str]:
    """(path, line number, new line) of a one-line gold patch."""
    path = re.search(r"^\+\+\+ b/(\S+)", patch, re.M)[1]
    line = int(re.search(r"^@@ -(\d+)", patch, re.M)[1])
    for text in patch.split("@@", 2)[2].splitlines()[1:]:
        if text.startswith("-"):
            break
        line += 1
    new = next(t[1:] for t in patch.splitlines() if t.startswith("+") and not t.startswith("+++"))
    return path, line, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a crr eval run directory")
    ap.add_argument("--tasks", default="nano-test")
    args = ap.parse_args()
    gold = {t.instance_id: gold_edit(t.patch) for t in load_tasks(args.tasks)}
    rewards = {(r["instance_id"], r["sample"]): r["reward"]
               for r in map(json.loads, (args.run / "results.jsonl").read_text().splitlines())}
    c = Counter()
    for r in map(json.loads, (args.run / "transcripts.jsonl").read_text().splitlines()):
        path, line, new = gold[r["instance_id"]]
        calls = [json.loads(s["action"]) for s in r["steps"]]
        views = [a["arguments"] for a in calls if a["name"] == "view_file" and "end" in a["arguments"]]
        edits = [a["arguments"] for a in calls if a["name"] == "edit_file"]
        c["episodes"] += 1
        c["solved"] += rewards[(r["instance_id"], r["sample"])] == 1
        c["line view"] += bool(views)
        c["line view of the gold line"] += any(v.get("path") == path and v.get("start") == line for v in views)
        if not edits:
            c["no edit"] += 1
            continue
        last = edits[-1]
        c["edit of the gold file"] += last.get("path") == path
        c["edit of the gold line"] += last.get("path") == path and last.get("start") == line
        c["gold replacement"] += last.get("replacement", "").rstrip("\n") == new
    print(json.dumps(dict(c)))


if __name__ == "__main__":
    main()
