"""How far does a from-random recipe's token budget go? SFT variants of experiments/sft-nano-2h.yaml, on a lent GPU.

A CPU run of the 2-hour recipe costs 2 hours; on a GPU the same rows train in minutes, so a few variants of the
stage-1 budget and learning rate can be compared side by side and their models evaluated back on the CPU with
`crr eval tasks nano-test`. Two steps:

    # here, after `crr sft --recipe experiments/sft-nano-2h.yaml --out DIR` has built its data:
    .venv/bin/python research/gpu_sft_sweep.py pack RUN_DIR .gpu      # rows (int16, ~7 MB) + the base model
    # on the GPU machine (torch and transformers only), one process per variant, side by side:
    python3 research/gpu_sft_sweep.py train .gpu NAME S1_EPOCHS S1_LR S2_EPOCHS S2_LR --out $OUT [--rows 0:5000,...]

`train` writes NAME.safetensors (bf16, tied embedding): copy it over model.safetensors in a copy of RUN_DIR/base_model
(plus crr/policy/default/crr_agent.json) to evaluate it. A hand loop rather than crr.sft.trainer because the
GPU machine has torch and transformers but not TRL, datasets or xgrammar (crr's trainer imports them); the loop has
the trainer's settings: AdamW (no weight decay), cosine schedule with 3 % warmup, gradient clip 1.0, bf16 autocast,
8 rows a step, right padding, the loss on the action tokens (crr.sft.trainer.action_nll), stage 1 (the
curriculum) in order and stage 2 (the expert's episodes) shuffled. Its numerics and stage-2 row order differ from
the CPU run's, so its pass@1 estimates the recipe's rather than reproduces it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch


def pack(run: Path, out: Path) -> None:
    from datasets import Dataset

    out.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for key, name in (("cur", "curriculum_data"), ("exp", "expert_data")):
        rows = Dataset.load_from_disk(str(run / name))
        ids, masks = rows["input_ids"], rows["assistant_masks"]
        arrays[f"{key}_ids"] = np.concatenate([np.asarray(r, np.int16) for r in ids])
        arrays[f"{key}_mask"] = np.concatenate([np.asarray(m, np.uint8) for m in masks])
        arrays[f"{key}_len"] = np.asarray([len(r) for r in ids], np.int64)
        print(json.dumps({"data": name, "rows": len(ids), "tokens": int(arrays[f"{key}_len"].sum())}))
    np.savez_compressed(out / "rows.npz", **arrays)
    shutil.rmtree(out / "base", ignore_errors=True)
    shutil.copytree(run / "base_model", out / "base")


def train(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    deadline = time.time() + args.budget_s
    z = np.load(args.data / "rows.npz")

    def rows(key: str) -> list[tuple[np.ndarray, np.ndarray]]:
        ids, lens, mask = z[f"{key}_ids"].astype(np.int64), z[f"{key}_len"], z[f"{key}_mask"]
        ends = np.cumsum(lens)
        return [(ids[e - n:e], mask[e - n:e]) for e, n in zip(ends, lens)]

    curriculum, expert = rows("cur"), rows("exp")
    if args.rows:
        curriculum = [r for part in args.rows.split(",") for r in curriculum[slice(*map(int, part.split(":")))]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.data / "base", dtype=torch.float32).to(device).train()
    pad = model.config.pad_token_id

    def save(tag: str) -> None:
        state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, str(args.out / f"{args.name}{tag}.safetensors"))

    def stage(data: list, epochs: float, lr: float, shuffle: bool, tag: str) -> None:
        steps = math.ceil(math.ceil(len(data) / 8) * epochs)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=device == "cuda")
        schedule = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * steps), steps)
        order_rng, step, start = torch.Generator().manual_seed(0), 0, time.time()
        while step < steps:
            order = torch.randperm(len(data), generator=order_rng).tolist() if shuffle else range(len(data))
            order = list(order)
            for i in range(0, len(order), 8):
                if step >= steps:
                    break
                chunk = [data[j] for j in order[i:i + 8]]
                width = max(len(ids) for ids, _ in chunk)
                ids = torch.full((len(chunk), width), pad)
                labels = torch.full((len(chunk), width), -100)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for k, (row, mask) in enumerate(chunk):
                    row_ids = torch.from_numpy(row)
                    ids[k, :len(row)], attention[k, :len(row)] = row_ids, 1
                    labels[k, :len(row)] = torch.where(torch.from_numpy(mask).bool(), row_ids, -100)
                ids, labels, attention = ids.to(device), labels.to(device), attention.to(device)
                with torch.autocast(device, dtype=torch.bfloat16):
                    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
                    target = labels[:, 1:]
                    logits = model.lm_head(hidden[target != -100]).float()
                loss = torch.nn.functional.cross_entropy(logits, target[target != -100])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                schedule.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step % 750 == 0 or step == steps:
                    print(json.dumps({"variant": args.name, "stage": tag, "step": step, "of": steps,
                                      "loss": round(loss.item(), 4), "s": round(time.time() - start, 1)}), flush=True)
                if time.time() > deadline:  # keep what there is: a model half-way is still a data point
                    save(f"-{tag}-step{step}")
                    print(json.dumps({"variant": args.name, "stage": tag, "stopped_at": step}), flush=True)
                    sys.exit(0)

    print(json.dumps({"variant": args.name, "curriculum_rows": len(curriculum),
                      "curriculum_tokens": int(sum(len(r) for r, _ in curriculum))}), flush=True)
    stage(curriculum, args.s1_epochs, args.s1_lr, False, "s1")
    if args.save_stage1:
        save("-s1")
    stage(expert, args.s2_epochs, args.s2_lr, True, "s2")
    save("")
    print(json.dumps({"variant": args.name, "done": True}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="a recipe run's rows and base model, to carry to the GPU machine")
    p.add_argument("run", type=Path)
    p.add_argument("out", type=Path)
    t = sub.add_parser("train", help="one variant: stage 1 on the curriculum, stage 2 on the expert's episodes")
    t.add_argument("data", type=Path)
    t.add_argument("name")
    for field in ("s1_epochs", "s1_lr", "s2_epochs", "s2_lr"):
        t.add_argument(field, type=float)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--rows", default=None, help="curriculum row ranges kept, e.g. 0:5000,7500:12500")
    t.add_argument("--save-stage1", action="store_true")
    t.add_argument("--budget-s", type=float, default=480, help="stop and save by then (the lease is short)")
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.run, args.out)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        train(args)


if __name__ == "__main__":
    main()
