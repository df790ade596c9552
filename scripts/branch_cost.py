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

`merge` asks what decoding the branches inside the rollout's own batches would save: an update's rounds today
are the rollout's (its longest trajectory) plus the branches' (their longest), and at best, with each branch
starting in the round after its parent trajectory's last call (its selector needs the whole trajectory), they
are the latest of the rollout's last round and every branch's last. The saving is priced at the seconds per
round of a least-squares fit of each update's ledger (cf_rollout_s = a x rounds + b x branch steps).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from crr.agent.conversation import action_text
from crr.agent.tools import ToolCall
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.rundir import read_jsonl
from crr.train.records import read_records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--model", default="crr/policy/multi", help="the run's model (its tokenizer and grammar)")
    args = ap.parse_args()
    model, tokenizer = load_policy(args.model)
    grammar = ToolCallGrammar(tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0])
    lengths: dict[str, dict[tuple, list[int]]] = {"trajectory": defaultdict(list), "branch": defaultdict(list)}
    ends: dict[int, dict[int, int]] = defaultdict(dict)            # update -> row -> its trajectory's rounds
    branch_steps: dict[int, list[tuple[int, int]]] = defaultdict(list)   # update -> (parent row, branch steps)
    for record in read_records(args.run):
        if record["kind"] == "trajectory":
            ends[record["update"]][record["row"]] = len(record["steps"])
        else:
            branch_steps[record["update"]].append((record["row"], len(record["steps"])))
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
    print(json.dumps(result, indent=2))


def merge(ends: dict, branch_steps: dict, run: Path) -> dict:
    updates = sorted(u for u in ends if branch_steps[u])
    rounds = [max(n for _, n in branch_steps[u]) for u in updates]   # the branches' own rounds
    steps = [sum(n for _, n in branch_steps[u]) for u in updates]
    after = [max(ends[u].values()) + r for u, r in zip(updates, rounds)]
    inside = [max([*ends[u].values(), *(ends[u][row] + n for row, n in branch_steps[u])]) for u in updates]
    ledger = {r["iteration"]: r for r in read_jsonl(run / "metrics.jsonl") if r.get("event") == "ledger"}
    (per_round, per_step), *_ = np.linalg.lstsq(np.array([rounds, steps], float).T,
                                                np.array([ledger[u]["cf_rollout_s"] for u in updates]), rcond=None)
    saved = sum(after) - sum(inside)
    return {"updates_with_branches": len(updates), "rounds_branches_after_rollout": sum(after),
            "rounds_branches_inside_rollout": sum(inside), "rounds_saved": saved,
            "fit_s_per_round": round(per_round, 3), "fit_s_per_branch_step": round(per_step, 3),
            "seconds_saved": round(saved * per_round, 1),
            "run_wall_s": round(json.loads((run / "summary.json").read_text())["cumulative"]["wall_s"], 1)}


if __name__ == "__main__":
    main()
