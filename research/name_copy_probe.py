"""Where a policy's copy breaks inside its edits: teacher-forced argmax accuracy on the edits of expert rows.

edit_file rows (default): the replacement lines' tokens, split into the first token of each name (a parameter,
local or function name: an identifier that is not a keyword, builtin or attribute) and every other token; the
first tokens of names again by how many distinct tokens follow the previous token in the context before the
edit (0: that token never occurs there; 1: copying what followed it there is unambiguous) and by whether the
token carries the space before the name (` k`, ` po`) or not (`(b`, `k`), and the mean pairwise
cosine of the (input) embeddings of the distinct name-first tokens against that of the other replacement tokens:
a figure near 1 says the model cannot tell those tokens apart, so a copy of one carries little of which one.
sed rows (--sed, the expert's `p_sed` episodes): the tokens of each `sed -i 'Ns/OLD/NEW/' PATH` command, split
into line number, OLD, NEW, path and the rest; and how often each of those parts is right in every token.

    .venv/bin/python research/name_copy_probe.py MODEL EXPERT_DATA [--rows 40] [--sed]
    .venv/bin/python research/name_copy_probe.py MODEL --curriculum 120 [--seed 999] [--level 0|1|2]

EXPERT_DATA: a `crr sft` run's expert_data/ (rows with input_ids and assistant_masks); --curriculum N probes N
fresh synthetic repair rows instead (crr.sft.curriculum, level 2 unless --level; no sandbox needed). Used for issue
11's warm-start attempts (experiments/sft-nano-lineview.yaml, sft-nano-copyloss.yaml, sft-nano-sed.yaml).
"""

from __future__ import annotations

import argparse
import builtins
import json
import keyword
import re
from collections import defaultdict

import datasets
import torch

from crr.agent.expert import SED_EDIT
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.sft.curriculum import curriculum_rows
from crr.sft.rows import action_parts, part_spans

NOT_NAMES = set(keyword.kwlist) | set(dir(builtins)) | {"upper", "lower"}
# A name starts at a letter or underscore that no word character, dot or backslash precedes: the backslash
# keeps the `n` of a JSON-escaped newline (`\n`, which ends every replacement) from counting as a name.
NAME = re.compile(r"(?<![\w.\\])[A-Za-z_]\w*")


def name_labels(text: str) -> list[str]:
    """Per character of a replacement: "name start" where a name begins, else "other"."""
    starts = {m.start() for m in NAME.finditer(text) if m.group() not in NOT_NAMES}
    return ["name start" if c in starts else "other" for c in range(len(text))]


def sed_labels(text: str) -> list[str] | None:
    """Per character of a command: the part of its sed substitution it writes (None: not a substitution)."""
    m = SED_EDIT.search(text)
    if m is None:
        return None
    labels = ["rest"] * len(text)
    for part in ("line", "old", "new", "path"):
        for c in range(m.start(part), max(m.end(part), m.start(part) + 1)):  # an empty NEW: its closing "/"
            labels[c] = part
    return labels


def followers(ids: list[int], end: int, token: int) -> str:
    """How many distinct tokens follow `token` in ids[:end]: "0", "1" or "2+"."""
    n = len({ids[j + 1] for j in range(end - 1) if ids[j] == token})
    return str(min(n, 2)) + ("+" if n >= 2 else "")


def mean_cosine(embeddings: torch.Tensor, ids: set[int]) -> float:
    """The mean cosine between the embedding rows of `ids`, over distinct pairs."""
    e = torch.nn.functional.normalize(embeddings[sorted(ids)].float(), dim=1)
    n = len(ids)
    return round(((e @ e.T).sum().item() - n) / (n * n - n), 3) if n > 1 else float("nan")


def probe_model(model, grammar: ToolCallGrammar, rows, sed: bool = False) -> dict:
    """The figures above for `rows`, teacher-forced (the model is left in eval mode)."""
    model.eval()
    part, label = ("command", sed_labels) if sed else ("replacement", name_labels)
    tokens, wholes, kinds = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0]), defaultdict(set)
    for row in rows:
        ids = row["input_ids"]
        parts = action_parts(grammar, ids, row["assistant_masks"])
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        for span in part_spans(parts, part):
            pieces = [grammar.token_bytes[ids[i]].decode("utf-8", errors="replace") for i in span]
            labels = label("".join(pieces))
            if labels is None:
                continue
            offset, whole = 0, defaultdict(lambda: True)
            for i, piece in zip(span, pieces):
                first = next((offset + c for c, ch in enumerate(piece) if not ch.isspace()), offset)
                kind, right = labels[min(first, len(labels) - 1)], int(pred[i - 1]) == ids[i]
                keys = [kind]
                if kind == "name start":  # a scan of the context: only for the few tokens it is reported for
                    keys.append(f"name start, previous token with {followers(ids, span[0], ids[i - 1])} distinct "
                                "followers")
                    keys.append("name start, space-led token" if piece.startswith(" ") else
                                "name start, token without a leading space")
                for key in keys:
                    tokens[key][0] += right
                    tokens[key][1] += 1
                kinds[kind].add(ids[i])
                whole[kind] &= right
                offset += len(piece)
            for kind, right in whole.items():
                wholes[kind][0] += right
                wholes[kind][1] += 1
    out = {kind: {"right": r, "tokens": n, "accuracy": round(r / n, 3)} for kind, (r, n) in sorted(tokens.items())}
    if sed:
        out["commands with the part right in every token"] = {kind: f"{r}/{n}" for kind, (r, n) in wholes.items()}
    else:
        embeddings = model.get_input_embeddings().weight
        out["mean pairwise cosine of the input embeddings"] = {
            f"{kind} tokens ({len(ids)} distinct)": mean_cosine(embeddings, ids) for kind, ids in kinds.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("data", nargs="?", help="a crr sft run's expert_data/")
    ap.add_argument("--rows", type=int, default=40, help="the first N rows")
    ap.add_argument("--sed", action="store_true", help="probe sed substitutions (run_shell) instead of edit_file")
    ap.add_argument("--curriculum", type=int, metavar="N", help="probe N fresh curriculum rows instead of DATA")
    ap.add_argument("--seed", type=int, default=999, help="the curriculum rows' seed")
    ap.add_argument("--level", type=int, choices=(0, 1, 2), default=2,
                    help="the curriculum rows' level (0: the view shows only the function the issue names)")
    args = ap.parse_args()
    if (args.data is None) == (args.curriculum is None):
        ap.error("give either EXPERT_DATA or --curriculum N")
    model, tokenizer = load_policy(args.model)
    grammar = ToolCallGrammar(tokenizer)
    if args.curriculum:
        rows = curriculum_rows(grammar, args.curriculum, args.seed, levels=(args.level,))
        source = {"curriculum rows": args.curriculum, "seed": args.seed, "level": args.level}
    else:
        rows = datasets.load_from_disk(args.data).select(range(args.rows))
        source = {"rows": args.rows}
    print(json.dumps({"model": args.model, **source, **probe_model(model, grammar, rows, args.sed)}))


if __name__ == "__main__":
    main()
