"""What a policy does on the multi tier: its calls in an evaluation's transcripts, by kind (issue 30's diagnosis of
each warm-start attempt, docs/multi-tier.md).

    .venv/bin/python research/multi_eval_calls.py results/reference/multi-warm-attempt2/multi-val [more eval dirs]

Per evaluation directory (a `crr eval` run: transcripts.jsonl, results.jsonl): episodes and how they ended (the
policy submitted, or hit the turn cap), calls by tool, calls naming a file that does not exist, calls cut off at
the token cap, other rejected calls, and edits of a file that holds one of the task's bugs.
"""

import argparse
import json
from collections import Counter
from pathlib import Path

import yaml

from crr.tasks.loaders import load_tasks


def _call(action: str) -> dict:
    try:
        call = json.loads(action)
    except (json.JSONDecodeError, TypeError):   # a call cut off at the token cap
        return {}
    return call if isinstance(call, dict) else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("evals", nargs="+", type=Path)
    args = ap.parse_args()
    for directory in args.evals:
        rows = [json.loads(line) for line in (directory / "transcripts.jsonl").open()]
        config = yaml.safe_load((directory / "config.yaml").read_text())
        bugs = {t.instance_id: {b["file"] for b in t.metadata.get("bugs", [])}
                for t in load_tasks(config["tasks"])[:config["n_tasks"]]}
        solved = sum(json.loads(line)["reward"] == 1.0 for line in (directory / "results.jsonl").open())
        c: Counter = Counter()
        for row in rows:
            steps = row["steps"]
            c["episodes"] += 1
            submitted = bool(steps) and _call(steps[-1]["action"]).get("name") == "submit_patch"
            c["submitted" if submitted else "not submitted"] += 1
            for step in steps:
                c["calls"] += 1
                obs = str(step.get("observation"))
                call = _call(step["action"])
                name = call.get("name", "?")
                c[f"tool {name}"] += 1
                if "does not exist" in obs[:200]:
                    c["names a file that does not exist"] += 1
                elif "cut off at" in obs[:80]:
                    c["cut off at the token cap"] += 1
                elif step.get("is_error"):
                    c["other rejected"] += 1
                if name == "edit_file" and not step.get("is_error") and \
                        call.get("arguments", {}).get("path") in bugs.get(row["instance_id"], set()):
                    c["edits of a buggy file"] += 1
        print(f"{directory}: solved {solved}/{c['episodes']}")
        for key, n in sorted(c.items(), key=lambda kv: (kv[0].startswith("tool"), kv[0])):
            print(f"  {key:36s} {n}")


if __name__ == "__main__":
    main()
