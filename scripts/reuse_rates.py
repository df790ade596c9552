"""How much of a training run's work the two exact savings would have spared, read off its trajectory records
(not a timed test): the share of on-policy trajectories and of branches that end in a state an earlier episode of
the run ended in (crr.agent.verdicts: the same task and the same edit_file/run_tests calls in order, no other
shell command), and the share of branches whose proposal a sibling of the same update had taken in the same
state (crr.train.counterfactual.played_by). Records hold calls, not tokens, so "the same action" and "the same
state" are compared by call here (the trainer compares tokens); a sibling stands for one branch, as there.

    .venv/bin/python scripts/reuse_rates.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from types import SimpleNamespace

from crr.agent.tools import ToolCallError, parse_tool_call
from crr.agent.verdicts import state_key
from crr.train.records import read_records


def call_of(text: str | None) -> dict | None:
    try:
        call = parse_tool_call(text or "")
    except ToolCallError:
        return None
    return {"name": call.name, "arguments": call.arguments}


def rates(run: str) -> dict:
    records = read_records(run)
    realised = {(r["update"], r["row"]): r for r in records if r["kind"] == "trajectory"}
    seen, counts = set(), defaultdict(lambda: [0, 0])   # kind -> [reused verdicts, scored episodes]
    played, forks, taken = 0, 0, defaultdict(set)   # update -> siblings standing for a branch
    for r in records:   # in the run's order: update by update, its trajectories, then its branches
        if r["reward"] is None:
            continue
        prefix = realised[(r["update"], r["row"])]["steps"][:r["t"]] if r["kind"] == "branch" else []
        steps = [SimpleNamespace(call=s.get("call")) for s in prefix + r["steps"]]
        task = SimpleNamespace(instance_id=r["task_id"], base_commit="")
        key = state_key(task, steps)
        counts[r["kind"]][1] += 1
        if key is not None and key in seen:
            counts[r["kind"]][0] += 1
        seen.add(key)
        if r["kind"] == "branch" and r.get("proposal") is not None:
            forks += 1
            proposal, calls = call_of(r["proposal"]), [s.get("call") for s in prefix]
            for (u, row), other in realised.items():
                if (u != r["update"] or row == r["row"] or row in taken[u] or other["task_id"] != r["task_id"]
                        or other["reward"] is None or len(other["steps"]) <= r["t"]):
                    continue
                if ([s.get("call") for s in other["steps"][:r["t"]]] == calls
                        and other["steps"][r["t"]].get("call") == proposal):
                    taken[u].add(row)
                    played += 1
                    break
    return {"verdicts_reused": {k: f"{n}/{m} ({n / m:.0%})" for k, (n, m) in counts.items()},
            "forks_a_sibling_played": f"{played}/{forks} ({played / max(forks, 1):.0%})"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    for run in ap.parse_args().runs:
        print(run, json.dumps(rates(run)))


if __name__ == "__main__":
    main()
