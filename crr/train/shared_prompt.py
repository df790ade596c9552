"""The learner's forward passes with each distinct prompt encoded once (shared-prefix GRPO, as Prefix Grouper,
arXiv 2506.05433, does for the loss).

A GRPO batch holds G rows per task whose prompt (s_0: the system prompt, the tools, the issue) is the same, and TRL
encodes it in every row: a nano task's prompt is about 960 tokens in the paper's agent format and 135 in the
compact one the CPU presets train in, beside completions of 550-1,500 tokens. Here the rows of a chunk that share
their prompt tokens (and padding) are grouped: each distinct prompt but its last token is encoded once into a
key/value cache, the cache is expanded to the group's rows (an index, so the gradient of every row flows back into
the one encoding), and the completions are scored after it with TRL's fused LM head, exactly as TRL scores them
after the full sequence: the same positions (a row's position ids count from the first column, padding included, in
both), the same mask, the same labels. Per token, log-probabilities and entropies equal TRL's up to floating-point
rounding, and so do the gradients (tests/test_shared_prompt.py).

Used by CRRTrainer._get_per_token_logps_and_entropies for the loss's pass and the reference pass, in a run of one
process (under DDP a module runs one forward pass per backward); rows with images, a mixture-of-experts auxiliary
loss, or layers that keep less than every token (sliding windows) take TRL's own path, and so does a pass with
gradients through checkpointed layers (the paper preset's `gradient_checkpointing`), which drop a cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from crr.policy.backend import CACHE_KEYWORD
from crr.policy.prefix_cache import full_attention


def shared_prompt_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int, batch_size: int, compute_entropy: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """TRL's per-token log-probabilities (and entropies) of the last `logits_to_keep` tokens of each row, in
    chunks of `batch_size` rows, each distinct prompt encoded once per chunk; None when no chunk has two rows
    with the same prompt (nothing to share), the model keeps less than every token's keys and values, or a pass
    with gradients runs through checkpointed layers."""
    prompt = input_ids.shape[1] - logits_to_keep
    if prompt < 2 or not full_attention(model.config):
        return None
    if torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) and m.training
                                       for m in model.modules()):
        return None   # a checkpointed layer drops the cache it is given (transformers' GradientCheckpointingLayer)
    rows = input_ids.shape[0]
    chunks = [(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
    heads = torch.cat([input_ids[:, :prompt], attention_mask[:, :prompt]], dim=1)
    groups = [torch.unique(heads[a:b], dim=0, return_inverse=True)[1] for a, b in chunks]   # each row's prompt
    if all(int(row_of.max()) + 1 == b - a for row_of, (a, b) in zip(groups, chunks)):
        return None
    logps, entropies = [], []
    for (a, b), row_of in zip(chunks, groups):
        first = [int((row_of == u).nonzero()[0]) + a for u in range(int(row_of.max()) + 1)]
        cache = DynamicCache(config=model.config)
        model(input_ids=input_ids[first, :prompt - 1], attention_mask=attention_mask[first, :prompt - 1],
              use_cache=True, logits_to_keep=1, **{CACHE_KEYWORD: cache})
        expanded = DynamicCache([(layer.keys[row_of], layer.values[row_of]) for layer in cache.layers],
                                config=model.config)
        labels = input_ids[a:b, prompt - 1:].masked_fill(attention_mask[a:b, prompt - 1:] == 0, -100)
        labels[:, 0] = -100   # the prompt's last token is fed, not scored
        out = model(input_ids=input_ids[a:b, prompt - 1:], attention_mask=attention_mask[a:b],
                    labels=labels, fused_lm_head=True, **{CACHE_KEYWORD: expanded})
        logps.append(out.log_probs[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(out.entropy[:, -logits_to_keep:])
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None
