"""Diagnostic for the report (issue 29, section 3): how much of a run's batched decoding fed rows whose call was
already complete, in the rollout and in the branches, read off a training run's trajectory records.

    .venv/bin/python scripts/branch_cost.py RUN_DIR [--model crr/policy/multi]

A decoding round is one batched call of the backend: the rollout decodes turn t of every trajectory of an update
together, the branches of an update decode their i-th step together (a branch's first step is its proposal).
Until a row left the batch when its call was complete, each round fed every row until its longest call ended, so
it fed rows x longest tokens where the calls needed the sum of their tokens; the ratio is the finished-row waste
that compaction removes. Tokens are each recorded call tokenized as the sampler emits it (the grammar's
tokenization; an unparsed action, its text's tokens). Exclusion retries of the proposal round are not in the
records and not counted.

`merge` asks what decoding the branches inside the rollout's own batches would save: an update's rounds with
the forks after the rollout are the rollout's (its longest trajectory) plus the branches' (their longest); with
each branch starting in the round after its parent trajectory's last call, they are the latest of the
rollout's last round and every branch's last; with each branch starting in the round after its own step t
(`live`: crr.train.counterfactual.LiveForks, the forks of steps in the running top-k of Eq. 4), the latest of
the rollout's last round and every branch's t + 1 + its steps. `live_forks` counts the forks that schedule
starts (a step in the selector's pick from its trajectory so far, at the run's k and eta) against the picks.
The saving is priced at the seconds per round of a least-squares fit of each update's ledger (cf_rollout_s =
a x rounds + b x branch steps).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from crr.agent.conversation import action_text
from crr.agent.tools import ToolCall, tool_type_score
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.rundir import read_jsonl, read_run_mapping
from crr.train.records import read_records
from crr.train.selectors import SelectorParams, select


class _Selectable:
    """A recorded step as the selector reads it (H_t, type(a_t), whether it is submit)."""

    def __init__(self, step: dict):
        call = step.get("call")
        self.entropy, self.terminal = step["entropy"], bool(call and call["name"] == "submit_patch")
        self.tool_type = None if call is None else tool_type_score(ToolCall(call["name"], call.get("arguments", {})))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", default="crr/policy/multi", help="the run's model (its tokenizer and grammar)")
    args = ap.parse_args()
    model, tokenizer = load_policy(args.model)
    grammar = ToolCallGrammar(tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0])
    lengths: dict[str, dict[tuple, list[int]]] = {"trajectory": defaultdict(list), "branch": defaultdict(list)}
    ends: dict[int, dict[int, int]] = defaultdict(dict)            # update -> row -> its trajectory's rounds
    branch_steps: dict[int, list[tuple[int, int, int]]] = defaultdict(list)   # update -> (parent row, t, branch steps)
    cfg = read_run_mapping(args.run / "config.yaml", "YAML")
    params = SelectorParams(k=cfg["k"], eta=cfg["eta"], lambda_type=cfg["lambda_type"])
    started = picked = 0
    for record in read_records(args.run):
        if record["kind"] == "trajectory":
            ends[record["update"]][record["row"]] = len(record["steps"])
            steps = [_Selectable(s) for s in record["steps"]]
            started += sum(any(c.t == t for c in select(cfg["selector"], steps[:t + 1], params))
                           for t in range(len(steps)))
            picked += len(select(cfg["selector"], steps, params))
        else:
            branch_steps[record["update"]].append((record["row"], record["t"], len(record["steps"])))
        for i, step in enumerate(record["steps"]):
            # a parsed call as the sampler emits it; an unparsed action (cut off, malformed), or a call the
            # grammar does not accept, by its text's tokens
            call = step.get("call")
            text = action_text(ToolCall(call["name"], call.get("arguments", {}))) if call else step.get("action") or ""
            ids = (grammar.tokenize(text) if call else None) or grammar.encode(text)
            round_key = (record["update"], step["t"] if record["kind"] == "trajectory" else i)
            lengths[record["kind"]][round_key].append(len(ids))
    result = {}
    for kind, rounds in lengths.items():
        needed = sum(sum(ls) for ls in rounds.values())
        fed = sum(len(ls) * max(ls) for ls in rounds.values())
        row_rounds = sum(map(len, rounds.values()))
        result[kind] = {"rounds": len(rounds), "row_rounds": row_rounds,
                        "rows_per_round": round(row_rounds / max(len(rounds), 1), 2),
                        "action_tokens": needed, "row_tokens_fed_before": fed,
                        "fed_over_needed": round(fed / needed, 3) if needed else None}
    result["merge"] = merge(ends, branch_steps, args.run)
    result["live_forks"] = {"started": started, "picked": picked}
    print(json.dumps(result, indent=2))


def merge(ends: dict, branch_steps: dict, run: Path) -> dict:
    updates = sorted(u for u in ends if branch_steps[u])
    rounds = [max(n for *_, n in branch_steps[u]) for u in updates]   # the branches' own rounds
    steps = [sum(n for *_, n in branch_steps[u]) for u in updates]
    after = [max(ends[u].values()) + r for u, r in zip(updates, rounds)]
    inside = [max([*ends[u].values(), *(ends[u][row] + n for row, _, n in branch_steps[u])]) for u in updates]
    live = [max([*ends[u].values(), *(t + 1 + n for _, t, n in branch_steps[u])]) for u in updates]
    ledger = {r["iteration"]: r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "ledger"}
    (per_round, per_step), *_ = np.linalg.lstsq(np.array([rounds, steps], float).T,
                                                np.array([ledger[u]["cf_rollout_s"] for u in updates]), rcond=None)
    saved = sum(after) - sum(inside)
    return {"updates_with_branches": len(updates), "rounds_branches_after_rollout": sum(after),
            "rounds_branches_inside_rollout": sum(inside), "rounds_saved": saved, "rounds_branches_live": sum(live),
            "rollout_rounds": sum(max(ends[u].values()) for u in updates),
            "fit_s_per_round": round(per_round, 3), "fit_s_per_branch_step": round(per_step, 3),
            "seconds_saved": round(saved * per_round, 1),
            "seconds_saved_live": round((sum(after) - sum(live)) * per_round, 1),
            "run_wall_s": round(json.loads((run / "summary.json").read_text())["cumulative"]["wall_s"], 1)}


if __name__ == "__main__":
    main()
