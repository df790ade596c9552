"""How many decoding passes would drafts (crr.policy.drafts) save, read off committed CRR runs?

For every branch of a run (trajectories/part-*.jsonl.gz), each of its calls after its proposal as the grammar's
tokens (ToolCallGrammar.tokenize of the call's JSON, arguments in the schema's order), decoded once as the sampler
decodes without drafts (a pass per free token: the grammar's forced tokens ride along) and once with a guess of up
to D tokens after each pass, from the last occurrence of the last n-gram (n <= 3) in its trajectory's calls from
a_t on: the passes with drafts over the passes without. The same for every trajectory's calls, drafting from its
own earlier calls. An estimate: a guess is kept for as long as it equals the call's tokens, every guess is D long,
and what a pass costs is not counted (docs/training.md, "Drafts").

    .venv/bin/python research/draft_potential.py MODEL RUN_DIR [RUN_DIR ...]   (D=8 by default; env D=N)
    e.g. crr/policy/multi results/reference/multi-main/runs/crr/*
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path

from transformers import AutoTokenizer

from crr.agent.tools import _PARAMS
from crr.policy.drafts import MAX_NGRAM, Drafts
from crr.policy.grammar import ToolCallGrammar


def call_ids(grammar: ToolCallGrammar, call: dict | None) -> list[int] | None:
    if not call:
        return None
    args = {k: call["arguments"][k] for k in _PARAMS[call["name"]]["properties"] if k in call["arguments"]}
    return grammar.tokenize(json.dumps({"name": call["name"], "arguments": args}))


def passes(grammar: ToolCallGrammar, ids: list[int], source: list[int], length: int) -> tuple[int, int]:
    """(passes without drafts, with drafts from `source`) to decode the call `ids`."""
    matcher, free = grammar.matcher(), []
    for token in ids:
        free.append(matcher.forced_token is None)
        matcher.advance(token)
    drafts, drafted, p = Drafts(source, length), 0, 0
    while p < len(ids):   # a pass determines ids[p], then the forced tokens after it ride along
        drafted += 1
        p += 1
        while p < len(ids) and not free[p]:
            p += 1
        guess = drafts.draft(ids[:p][-MAX_NGRAM:], len(ids) - p) if source else []
        kept = next((k for k, (g, t) in enumerate(zip(guess, ids[p:])) if g != t), min(len(guess), len(ids) - p))
        p += kept
    return sum(free), drafted


def main() -> None:
    model, *runs = sys.argv[1:]
    grammar, length = ToolCallGrammar(AutoTokenizer.from_pretrained(model)), int(os.environ.get("D", 8))
    for run in map(Path, runs):
        trajectories, branches = {}, []
        for part in sorted((run / "trajectories").glob("part-*.jsonl.gz")):
            for line in gzip.open(part).read().decode().splitlines():
                record = json.loads(line)
                if record["kind"] == "trajectory":
                    trajectories[record["update"], record["row"]] = record
                elif record["kind"] == "branch":
                    branches.append(record)
        counts = {"branch": [0, 0], "trajectory": [0, 0]}
        for branch in branches:
            parent = trajectories.get((branch["update"], branch["row"]))
            if parent is None:
                continue
            source = [i for s in parent["steps"][branch["t"]:] for i in call_ids(grammar, s.get("call")) or []]
            for step in branch["steps"][1:]:
                if ids := call_ids(grammar, step.get("call")):
                    plain, drafted = passes(grammar, ids, source, length)
                    counts["branch"][0] += plain
                    counts["branch"][1] += drafted
        for record in trajectories.values():
            source = []
            for step in record["steps"]:
                if ids := call_ids(grammar, step.get("call")):
                    plain, drafted = passes(grammar, ids, source, length)
                    counts["trajectory"][0] += plain
                    counts["trajectory"][1] += drafted
                    source += ids
        share = {kind: drafted / plain for kind, (plain, drafted) in counts.items()}
        print(f"{run.name}: {len(branches)} branches; passes with drafts / without: branches' calls "
              f"{share['branch']:.2f}, trajectories' {share['trajectory']:.2f}")


if __name__ == "__main__":
    main()
