"""Benchmark for the report (not a test): how far the decoder's log-probabilities are from the policy's. For every
step of a `crr rollout` trajectories file, the per-token log-probabilities of the action (untempered, unmasked)
under the shipped default with a LoRA adapter (crr's default r and alpha, the paper's; B = 0, as training starts, or
drawn with --lora-std so that the merge has a delta to add): as the rollout recorded them (the decoder of the commit
that made the file; B = 0 only, since the rollout ran the shipped default), as the
TransformersBackend's teacher-forced pass gives them now (on a CPU a LoRA policy's float32 merged copy), as the
loss's forward pass computes them (the LoRA model in its own dtype, the whole sequence at once), and in float64
(the same weights). Prints the mean and largest absolute difference per token between them.

    .venv/bin/crr rollout --tasks nano-band --n 4 --group 4 --out DIR
    .venv/bin/python scripts/decoder_fidelity.py DIR/*/trajectories.jsonl [--lora-std 0.01]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from peft import LoraConfig, get_peft_model

from crr.policy.backend import TransformersBackend
from crr.policy.model import SHIPPED_DEFAULT, load_policy
from crr.train.config import load_config


def forward(model, pairs) -> list[list[float]]:
    """Per-token log-probabilities of each action from one full forward pass (as the loss computes them)."""
    out = []
    with torch.no_grad():
        for context, action in pairs:
            logp = torch.log_softmax(model(input_ids=torch.tensor([context + action])).logits[0].double(), -1)
            out.append([float(logp[len(context) + k - 1, token]) for k, token in enumerate(action)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trajectories")
    ap.add_argument("--lora-std", type=float, default=0.0,
                    help="std of the adapter's B (default 0: the initial adapter)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_policy(SHIPPED_DEFAULT)
    cfg = load_config()
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                             task_type="CAUSAL_LM", target_modules=cfg.lora_target_modules))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, args.lora_std)
    pairs, recorded = [], []
    for line in open(args.trajectories):
        traj = json.loads(line)
        context = list(traj["prompt_ids"])
        for step in traj["steps"]:
            pairs.append((list(context), step["action_ids"]))
            recorded.append(step["policy_logprobs"])
            context += step["action_ids"] + (step["observation_ids"] or [])
    backend = TransformersBackend(model, tokenizer)
    decoder = []
    for context, action in pairs:
        backend.prefix_cache.clear()   # each pass from the prompt, not from a neighbour's cached keys
        decoder.append(backend.score(context, action, 1.0)["policy_logprobs"])
    loss = forward(model, pairs)
    series = {**({"recorded by the rollout": recorded} if args.lora_std == 0 else {}),
              f"decoder now ({'float32 merged copy' if backend._merged is not None else 'through the adapter'})":
                  decoder,
              f"loss ({model.dtype}, whole sequence)": loss}
    float64 = forward(copy.deepcopy(model).to(torch.float64), pairs)
    print(f"{len(pairs)} steps, {sum(map(len, loss))} tokens; |difference| per token, mean / max")
    for name, values in series.items():
        cells = []
        for other in (loss, float64):
            d = [abs(a - b) for xs, ys in zip(values, other) for a, b in zip(xs, ys)]
            cells.append(f"{sum(d) / len(d):.1e} / {max(d):.1e}")
        print(f"  {name:44s} from the loss {cells[0]:17s} from float64 {cells[1]}")


if __name__ == "__main__":
    main()
