"""Would drafted (speculative) decoding make a branch cheaper? (issue 29, section 3; docs/training.md, "Drafted
decoding") Two measurements with the shipped default in float32 (the merged decoder of training runs), on one
intra-op thread, each the median of 7 passes over a fresh copy of a 600-token key/value cache:

  rows    one decoding pass (1 token a row) of B = 1, 2, 4, 8, 12, 16 rows: what a pass costs as a batch grows.
  width   one pass of 8 rows feeding W = 1, 2, 4, 8, 16 tokens a row: what verifying a draft of W - 1 tokens costs
          against decoding one token.

The profile it is read beside is cProfile's of `crr rollout --tasks nano-band --n 2 --group 8` (the docs give it).

    .venv/bin/python research/decode_pass_probe.py
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from crr.policy.model import default_policy_dir, load_policy

CACHE_TOKENS = 600


def pass_ms(model: torch.nn.Module, rows: int, width: int, repeats: int = 7) -> float:
    """The median milliseconds of one cached forward pass of `rows` rows feeding `width` tokens each."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (rows, CACHE_TOKENS), generator=generator)
    cache = model(input_ids=prompt, use_cache=True).past_key_values
    times = []
    for _ in range(repeats):
        past, fed = copy.deepcopy(cache), torch.randint(100, 1000, (rows, width), generator=generator)
        start = time.perf_counter()
        model(input_ids=fed, past_key_values=past, use_cache=True, logits_to_keep=width)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    model, _ = load_policy(str(default_policy_dir()))
    model = model.float().eval()
    print("rows  (1 token a row): " + ", ".join(f"B={b} {pass_ms(model, b, 1):.1f} ms" for b in (1, 2, 4, 8, 12, 16)))
    print("width (8 rows):        " + ", ".join(f"W={w} {pass_ms(model, 8, w):.1f} ms" for w in (1, 2, 4, 8, 16)))


if __name__ == "__main__":
    main()
