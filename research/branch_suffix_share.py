"""What share of a trajectory's generated tokens does a counterfactual branch decode again?

A branch from a selected step t plays a~_t and everything after it, and runs the verifier as the trajectory did;
so at the same cost per token as a rollout row, its own seconds are at least this share of a trajectory's
(section 3 of issue 29 asks for at most half). For every selected step of the on-policy trajectories a CRR run
recorded (trajectories/part-*.jsonl.gz), the tokens of the calls from step t on over those of the whole
trajectory, each call counted as its JSON under the policy's tokenizer (the grammar forces some of those tokens,
so it approximates the decoded ones).

    .venv/bin/python research/branch_suffix_share.py MODEL RUN_DIR [RUN_DIR ...]
    e.g. crr/policy/default results/reference/cpu-main/runs/crr/*
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

from transformers import AutoTokenizer


def suffix_shares(run: Path, tokenizer) -> tuple[list[float], list[int]]:
    """Per selected step: the suffix's share of the trajectory's call tokens, and how many steps it holds."""
    shares, steps = [], []
    for part in sorted((run / "trajectories").glob("part-*.jsonl.gz")):
        for line in gzip.open(part).read().decode().splitlines():
            record = json.loads(line)
            if record.get("kind") != "trajectory":
                continue
            tokens = [len(tokenizer(json.dumps(s.get("call") or ""))["input_ids"]) for s in record["steps"]]
            for t, step in enumerate(record["steps"]):
                if step.get("selected"):
                    shares.append(sum(tokens[t:]) / sum(tokens))
                    steps.append(len(tokens) - t)
    return shares, steps


def main() -> None:
    model, *runs = sys.argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(model)
    for run in map(Path, runs):
        shares, steps = suffix_shares(run, tokenizer)
        print(f"{run.name}: {len(shares)} selected steps; a branch decodes {statistics.mean(shares):.2f} of its "
              f"trajectory's call tokens (median {statistics.median(shares):.2f}) over {statistics.mean(steps):.2f} "
              "steps on average")


if __name__ == "__main__":
    main()
