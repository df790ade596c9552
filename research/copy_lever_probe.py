"""Does a lever move the copy? Fine-tune a model for a few minutes on fresh curriculum rows and probe it as it goes.

Issue 11's warm start is capped by one token: the first token of a name in an edit's replacement
(research/name_copy_probe.py). A full recipe and evaluation cost an hour or more here; this script tells in minutes
whether a change to the model or the rows moves that token at all, teacher-forced on held-out curriculum rows
(the same rows every time: crr.sft.curriculum, seed 999, the larger level). Levers (--lever):

    control   the model as it is
    kv6       every attention layer's 2 key/value heads copied into 6, one per query head (the same function,
              0.3M more parameters): more room to match and move a name
    drill     rows with 8 more edits each, every one rewriting a random viewed line unchanged by its number,
              the loss only on the replacements: many more name starts to copy per token of compute
    qknorm    the query/key RMSNorm gains (Qwen3 normalises queries and keys, so with head_dim 32 an attention
              logit stays near 6-7 at most) at 33x the learning rate, free to sharpen attention
    untie     a separate output embedding, its rows of the one- and two-letter name starts (` k`, ` b`, ` st`, ...)
              spread 1.5x from their mean: the tied embeddings of those tokens are nearly parallel
    spread    the same rows spread 2x in the tied embedding (input and output alike)
    lm        the loss on every token, the observations (files, diffs) and prompt as well as the calls: a language
              model's objective, six times the supervised tokens per row at the same compute, and the one under
              which small transformers grow copy (induction) heads

    .venv/bin/python research/copy_lever_probe.py --lever kv6 --minutes 10 [--threads 1] [--out FILE.jsonl]
    .venv/bin/python research/copy_lever_probe.py --model RANDOM --lever lm --lr 1e-3 --levels 0 1 --probe-level 1

(--model a random model, e.g. `crr model init`'s re-split by crr.policy.model.write_split_model: how fast a lever
grows the copy from random weights; --levels the training rows' curriculum levels, --probe-level the held-out rows'.)

A plain loop (AdamW, bf16 autocast, batches of 8, linear warm-up) rather than TRL's SFTTrainer: the probe runs
between steps on the model in memory, and the levers change the model's modules before the optimiser is built.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

import torch
from name_copy_probe import probe_model  # this directory is on sys.path when run as a script

from crr.agent.conversation import action_message
from crr.agent.expert import call_json
from crr.agent.tools import ToolCall
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy
from crr.sft.curriculum import curriculum_rows, repair_messages
from crr.sft.rows import action_parts, sft_row

LEVERS = ("control", "kv6", "drill", "qknorm", "untie", "spread", "lm")


def expand_kv_heads(model, n_kv: int) -> None:
    """Each key/value head copied into n_kv / old heads, in the order the query heads use them: same outputs."""
    cfg = model.config
    old, hd = cfg.num_key_value_heads, cfg.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            lin = getattr(attn, name)
            new = torch.nn.Linear(lin.in_features, n_kv * hd, bias=False)
            new.weight.data.copy_(lin.weight.data.view(old, hd, -1).repeat_interleave(n_kv // old, 0)
                                  .reshape(n_kv * hd, -1))
            setattr(attn, name, new)
        attn.num_key_value_groups = cfg.num_attention_heads // n_kv
    cfg.num_key_value_heads = n_kv


def spread_onsets(model, grammar: ToolCallGrammar, beta: float, untie: bool) -> None:
    """The embedding rows of ` a`-` zz` (one or two letters after a space) spread beta x from their mean: in a
    separate output embedding (untie) or in the tied one."""
    w = model.get_input_embeddings().weight.data.clone()
    onsets = [i for i, b in enumerate(grammar.token_bytes) if re.fullmatch(rb" [a-z]{1,2}", b or b"")]
    mean = w[onsets].mean(0)
    w[onsets] = mean + beta * (w[onsets] - mean)
    if not untie:
        model.get_input_embeddings().weight.data.copy_(w)   # tied: the output embedding is the same tensor
        return
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight.data = w
    model.config.tie_word_embeddings = False
    model.lm_head = head


def drill_row(grammar: ToolCallGrammar, rng: random.Random, k: int = 8) -> dict:
    """A curriculum repair with k unchanged rewrites of random viewed lines before its edit; loss on replacements."""
    messages = None
    while messages is None:
        messages = repair_messages(rng, rng.choice((1, 2)), 8)
    view = messages[3]["content"]                      # system, issue, view_file, its observation, edit, ...
    path, lines = view.split(":")[0], [ln.split("\t", 1)[1] for ln in view.split("\n")[1:] if "\t" in ln]
    numbers = [n for n, ln in enumerate(lines, 1) if ln.strip() and not ln.strip().startswith('"""')]
    drills = []
    for n in rng.choices(numbers, k=k):
        call = ToolCall("edit_file", {"path": path, "start": n, "end": n, "replacement": lines[n - 1]})
        drills += [action_message(call_json(call)), {"role": "tool", "name": "edit_file", "content": "\n"}]
    row = sft_row(grammar, messages[:4] + drills + messages[4:], [])
    parts = action_parts(grammar, row["input_ids"], row["assistant_masks"])
    return {**row, "assistant_masks": [int(p == "replacement") for p in parts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lever", choices=LEVERS, default="control")
    ap.add_argument("--model", default="crr/policy/default")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--probe-every", type=float, default=5, help="minutes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="curriculum levels of the training rows")
    ap.add_argument("--probe-level", type=int, default=2, help="curriculum level of the held-out rows")
    ap.add_argument("--out", help="also append each probe as a JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_policy(args.model, dtype=torch.float32)
    grammar = ToolCallGrammar(tokenizer)
    if args.lever == "kv6":
        expand_kv_heads(model, model.config.num_attention_heads)
    if args.lever in ("untie", "spread"):
        spread_onsets(model, grammar, *((1.5, True) if args.lever == "untie" else (2.0, False)))
    held_out = curriculum_rows(grammar, 80, seed=999, levels=(args.probe_level,))
    rng = random.Random(f"copy-lever:{args.seed}")
    n_rows = int(args.minutes * 60 * 5)  # more than any lever trains on in the time (about 4 rows/s on 2 cores)
    rows = ([drill_row(grammar, rng) for _ in range(n_rows)] if args.lever == "drill"
            else curriculum_rows(grammar, n_rows, seed=1000 + args.seed, levels=tuple(args.levels)))
    rng.shuffle(rows)
    norms = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    rest = [p for n, p in model.named_parameters() if not n.endswith(("q_norm.weight", "k_norm.weight"))]
    boost = 33.0 if args.lever == "qknorm" else 1.0
    opt = torch.optim.AdamW([{"params": rest, "scale": 1.0}, {"params": norms, "scale": boost}], lr=args.lr,
                            weight_decay=0.0)

    def record(t: float, tokens: int, **extra) -> None:
        p = probe_model(model, grammar, held_out)
        line = json.dumps({"lever": args.lever, "minutes": round(t / 60, 1), "tokens": tokens, **extra,
                           "name start": p["name start"]["accuracy"], "other": p["other"]["accuracy"],
                           "qk gain": round(sum(n.mean().item() for n in norms) / len(norms), 3)})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    record(0, 0)
    start = last = time.time()
    tokens, probed, pad = 0, 0, tokenizer.pad_token_id
    for step, i in enumerate(range(0, len(rows), 8)):
        if time.time() - start > args.minutes * 60:
            break
        model.train()  # the probe leaves it in eval mode
        batch = rows[i:i + 8]
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for b, r in enumerate(batch):
            x, n = torch.tensor(r["input_ids"]), len(r["input_ids"])
            ids[b, :n], attention[b, :n] = x, 1
            labels[b, :n] = x if args.lever == "lm" else torch.where(torch.tensor(r["assistant_masks"]).bool(), x, -100)
        for group in opt.param_groups:
            group["lr"] = args.lr * group["scale"] * min(1.0, (step + 1) / 20)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        tokens += int(attention.sum())
        if time.time() - last > args.probe_every * 60:
            last, probed = time.time(), tokens
            record(last - start, tokens, loss=round(loss.item(), 3))
    if tokens != probed:
        record(time.time() - start, tokens, loss=round(loss.item(), 3))


if __name__ == "__main__":
    sys.exit(main())
