"""Issue 11's tokenizer lever, measured small: can the tiny Qwen3 from random weights learn to find a function by
its name in a nano module and copy its first body line, with the default tokenizer or with one whose BPE also saw
nano modules (so pseudo-words get merges of their own)?

Rows: a nano module of the train split as view_file renders it, then `copy: NAME` and the target, the line after
NAME's docstring (the line nano bugs live on); the loss only on the target. A curriculum in the number of
functions in the file, 1, then 2, then all of the module's 2-4 (as ../shared/notes/copy_curriculum.py found
necessary): a level is left once the model copies 80 % of its held-out lines exactly. Held out per level: modules
of the test split (its disjoint vocabulary), scored teacher-forced: token accuracy, a name's first token, and the
whole line right.

    .venv/bin/python research/tokenizer_probe.py default|nano [--minutes 18] [--threads 1] [--untied]

--untied gives the model separate input and output embeddings (the default ties them, as the shipped model does):
the shipped model's tied embeddings of the tokens that start names ended up nearly parallel
(research/name_copy_probe.py), and the run ends by printing that figure for the model it trained.

Prints the tokens per held-out name of the tokenizer, then one JSON line per evaluation (the level trained, the
tokens seen, the scores at that level) and at the end the scores at every level.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from name_copy_probe import mean_cosine, name_labels  # this directory is on sys.path when run as a script
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from crr.agent.tools import render_view, split_lines
from crr.policy.model import SIZES, default_model_dir, train_tokenizer
from crr.tasks.nano import nano_template


def functions(split: str, rng: random.Random) -> list[tuple[str, str]]:
    """(name, source) of every function of one module of a fresh nano package."""
    module = rng.choice(nano_template(rng, split).modules)
    chunks = module.source.split("\n\n\n")[1:]
    return [(c.split("(")[0].removeprefix("def "), c.rstrip("\n") + "\n") for c in chunks]


def row(tokenizer, split: str, rng: random.Random, k: int | None) -> tuple[list[int], list[int], list[str]]:
    """input ids, labels (-100 outside the target) and each target token's kind ("name1" or "other")."""
    fns = functions(split, rng)
    fns = fns[:k] if k else fns
    name, source = rng.choice(fns)
    text = "\n\n\n".join(src for _, src in fns)
    target = source.splitlines()[2] + "\n"
    prompt = render_view("pkg/mod.py", split_lines(text)) + f"copy: {name}\n"
    p = tokenizer.encode(prompt, add_special_tokens=False)
    t = tokenizer.encode(target, add_special_tokens=False)
    labels = name_labels(target)  # the same names as name_copy_probe's: not keywords, builtins or methods
    kinds, off = [], 0
    for i in t:
        piece = tokenizer.decode([i])
        first = next((off + c for c, ch in enumerate(piece) if not ch.isspace()), off)
        kinds.append("name1" if labels[min(first, len(labels) - 1)] == "name start" else "other")
        off += len(piece)
    return p + t, [-100] * len(p) + t, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tokenizer", choices=["default", "nano"])
    ap.add_argument("--minutes", type=float, default=18)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--untied", action="store_true", help="separate input and output embeddings")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.tokenizer == "default":
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    else:
        rng = random.Random("tokenizer")
        tokenizer = train_tokenizer(extra=(nano_template(rng, "train").modules[0].source for _ in range(3000)))
    names = [n for _ in range(200) for n, _ in functions("test", random.Random(_))]
    per_name = sum(len(tokenizer.encode(" " + n, add_special_tokens=False)) for n in names) / len(names)
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=not args.untied,
                         pad_token_id=tokenizer.pad_token_id, **SIZES["tiny"])
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    levels = (1, 2, None)  # functions in the file (None: all of the module's)
    held_rng = random.Random(f"held{args.seed}")
    held = {k: [row(tokenizer, "test", held_rng, k) for _ in range(64)] for k in levels}
    train_rng = random.Random(f"train{args.seed}")
    print(json.dumps({"tokenizer": args.tokenizer, "tied": not args.untied, "vocab": len(tokenizer),
                      "tokens_per_test_name": round(per_name, 2),
                      "parameters": sum(p.numel() for p in model.parameters())}), flush=True)

    def evaluate(rows) -> dict:
        model.eval()
        right = {"name1": [0, 0], "other": [0, 0]}
        whole = 0
        with torch.no_grad():
            for ids, _, kinds in rows:
                pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
                n = len(kinds)
                ok = [int(pred[len(ids) - n - 1 + j]) == ids[len(ids) - n + j] for j in range(n)]
                for kind, r in zip(kinds, ok):
                    right[kind][0] += r
                    right[kind][1] += 1
                whole += all(ok)
        model.train()
        return {k: round(a / max(b, 1), 3) for k, (a, b) in right.items()} | {"line": round(whole / len(rows), 3)}

    t0, step, tokens, last, level = time.time(), 0, 0, time.time(), 0
    budget = args.minutes * 60
    while time.time() - t0 < budget:
        batch = [row(tokenizer, "train", train_rng, levels[level]) for _ in range(16)]
        width = max(len(b[0]) for b in batch)
        x = torch.tensor([b[0] + [tokenizer.pad_token_id] * (width - len(b[0])) for b in batch])
        y = torch.tensor([b[1] + [-100] * (width - len(b[1])) for b in batch])
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        step += 1
        tokens += x.numel()
        if time.time() - last > 60:
            last = time.time()
            scores = evaluate(held[levels[level]])
            print(json.dumps({"minute": round((last - t0) / 60, 1), "step": step, "tokens": tokens,
                              "level": levels[level] or "all", "loss": round(loss.item(), 3), **scores}), flush=True)
            if scores["line"] >= 0.8 and level + 1 < len(levels):
                level += 1
    name1 = {ids[len(ids) - len(kinds) + j] for ids, _, kinds in held[None] for j, k in enumerate(kinds)
             if k == "name1"}
    cosine = {"input": mean_cosine(model.get_input_embeddings().weight.data, name1),
              "output": mean_cosine(model.get_output_embeddings().weight.data, name1)}
    print(json.dumps({"minute": round((time.time() - t0) / 60, 1), "step": step, "tokens": tokens, "final": True,
                      **{str(k or "all"): evaluate(rows) for k, rows in held.items()},
                      "mean pairwise cosine of the name-first tokens' embeddings": cosine}), flush=True)


if __name__ == "__main__":
    main()
