"""How well a policy copies a failing function's name into its grep, teacher-forced (issue 30's multi warm start).

The fourth multi warm start greps for a miscopied name in 113 of 124 greps, nearly always with its first letter
wrong (docs/multi-tier.md). This probe draws fresh locate rows (crr.sft.locate, level 3 of the curriculum) named
from a split's vocabulary (val by default: names no training row holds), feeds each row to the model, and reports
the argmax accuracy at the name in every `grep -rn 'def NAME(' PKG` command: at its first token, at the rest, and
over the whole name (every token right), by the issue's style.

With `--edits` it probes the edits instead (the eighth warm start's regressions are mostly the right fix on the
wrong line): it draws whole multi episodes (level 4: every bug located and fixed, then submit) and reports, for
every edit_file call, how often the argmax writes its start line, its end line, its replacement and the whole call
right, given the episode up to that call.

    .venv/bin/python research/grep_copy_probe.py MODEL [MODEL ...] [--rows 60] [--seed 7] [--split val] [--edits]
"""

from __future__ import annotations

import argparse
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from itertools import groupby

import torch

from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.sft.locate import locate_calls
from crr.sft.rows import action_parts, part_spans, scripted_messages, sft_row


def rows(grammar: ToolCallGrammar, n: int, seed: int, split: str, whole: bool = False) -> list[tuple[str, dict]]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        drawn = locate_calls(rng, split, whole)
        if drawn is not None:
            style = "test_id" if drawn[0].startswith("Failing tests") else "call"
            out.append((style, sft_row(grammar, scripted_messages(*drawn, 12), [])))
    return out


def teacher_forced(model, grammar: ToolCallGrammar, drawn: list[tuple[str, dict]]) -> Iterator[tuple]:
    """(style, row, the action part each token writes, the argmax before each token) for every drawn row."""
    model.eval()
    for style, row in drawn:
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([row["input_ids"]])).logits[0].argmax(-1)
        yield style, row, action_parts(grammar, row["input_ids"], row["assistant_masks"]), pred


def rates(counts: Iterable[tuple[str, list[int]]]) -> dict:
    return {key: f"{r}/{n} = {r / n:.3f}" for key, (r, n) in counts}


def probe(model, grammar: ToolCallGrammar, drawn: list[tuple[str, dict]]) -> dict:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for style, row, parts, pred in teacher_forced(model, grammar, drawn):
        ids = row["input_ids"]
        for span in part_spans(parts, "command"):
            pieces = [grammar.token_bytes[ids[i]].decode("utf-8", errors="replace") for i in span]
            text = "".join(pieces)
            m = re.match(r"grep -rn 'def (\w+)\(", text)
            if m is None:
                continue
            offset, name = 0, []
            for i, piece in zip(span, pieces):  # the tokens that write some of the name
                if offset < m.end(1) and offset + len(piece) > m.start(1):
                    name.append(int(pred[i - 1]) == ids[i])
                offset += len(piece)
            for key, right in ((f"{style}: first token", name[0]), (f"{style}: other tokens", None),
                               (f"{style}: whole name", all(name))):
                if right is None:
                    counts[key][0] += sum(name[1:])
                    counts[key][1] += len(name) - 1
                else:
                    counts[key][0] += right
                    counts[key][1] += 1
    return rates(sorted(counts.items()))


def edit_probe(model, grammar: ToolCallGrammar, drawn: list[tuple[str, dict]]) -> dict:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _, row, parts, pred in teacher_forced(model, grammar, drawn):
        ids, mask = row["input_ids"], row["assistant_masks"]
        for is_action, run in groupby(range(len(ids)), key=lambda k: bool(mask[k])):
            call = list(run)
            text = "".join(grammar.token_bytes[ids[i]].decode("utf-8", errors="replace") for i in call)
            if not is_action or '"edit_file"' not in text:
                continue
            right = {key: all(int(pred[i - 1]) == ids[i] for i in call if parts[i] == key)
                     for key in ("path", "start", "end", "replacement")}
            right["whole call"] = all(right.values())
            for key, ok in right.items():
                counts[key][0] += ok
                counts[key][1] += 1
    return rates(counts.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", type=int, default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--split", default="val", choices=("train", "val", "test"))
    ap.add_argument("--edits", action="store_true", help="probe the edit_file calls of whole episodes (level 4)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    drawn = None
    for path in args.models:
        model, tokenizer = load_policy(path)
        grammar = ToolCallGrammar(tokenizer)
        drawn = drawn or rows(grammar, args.rows, args.seed, args.split, whole=args.edits)
        print(path)
        for key, value in (edit_probe if args.edits else probe)(model, grammar, drawn).items():
            print(f"  {key:28s} {value}")


if __name__ == "__main__":
    main()
