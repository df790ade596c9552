"""Where a policy's copy of names breaks: teacher-forced argmax accuracy on the replacement lines of expert rows,
split into the first token of each name (a parameter, local or function name: an identifier that is not a
keyword, builtin or attribute) and every other replacement token.

    .venv/bin/python scripts/name_copy_probe.py MODEL EXPERT_DATA [--rows 40]

EXPERT_DATA: a `crr sft` run's expert_data/ (rows with input_ids and assistant_masks). Used for issue 11's
warm-start attempts (experiments/sft-nano-lineview.yaml, sft-nano-copyloss.yaml).
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import re

import datasets
import torch

from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.policy.rows import action_parts

NOT_NAMES = set(keyword.kwlist) | set(dir(builtins)) | {"upper", "lower"}


def name_starts(text: str) -> set[int]:
    """Character offsets in `text` where a name begins."""
    return {m.start() for m in re.finditer(r"(?<![\w.])[A-Za-z_]\w*", text) if m.group() not in NOT_NAMES}


def probe(model_dir: str, rows) -> dict:
    model, tokenizer = load_policy(model_dir)
    model.eval()
    grammar = ToolCallGrammar(tokenizer)
    counts = {"name start": [0, 0], "other": [0, 0]}
    for row in rows:
        ids = row["input_ids"]
        parts = action_parts(grammar, ids, row["assistant_masks"])
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        k = 0
        while k < len(ids):
            if parts[k] != "replacement":
                k += 1
                continue
            span = []
            while k < len(ids) and parts[k] == "replacement":
                span.append(k)
                k += 1
            pieces = [grammar.token_bytes[ids[i]].decode("utf-8", errors="replace") for i in span]
            starts, offset = name_starts("".join(pieces)), 0
            for i, piece in zip(span, pieces):
                first = next((c for c in range(offset, offset + len(piece)) if not piece[c - offset].isspace()), None)
                kind = "name start" if first in starts else "other"
                counts[kind][0] += int(pred[i - 1]) == ids[i]
                counts[kind][1] += 1
                offset += len(piece)
    return {kind: {"right": r, "tokens": n, "accuracy": round(r / n, 3) if n else None}
            for kind, (r, n) in counts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data", help="a crr sft run's expert_data/")
    ap.add_argument("--rows", type=int, default=40, help="the first N rows")
    args = ap.parse_args()
    rows = datasets.load_from_disk(args.data).select(range(args.rows))
    print(json.dumps({"model": args.model, "rows": args.rows, **probe(args.model, rows)}))


if __name__ == "__main__":
    main()
