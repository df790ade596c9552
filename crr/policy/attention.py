"""Grouped-query attention for decoding passes that feed a row several tokens, without copying the cache.

The sampler (crr.policy.backend) feeds a row a block of tokens per pass: its sampled token, the tokens the
grammar forces after it and a guess of what follows (crr.policy.drafts). transformers' SDPA attention runs a
one-token query on the key/value heads (its `pack_gqa`), but for a longer one it repeats the keys and values
once per query head sharing them (`repeat_kv`): a copy of the whole cache, every layer, every pass. Here the
query heads that share a key/value head are packed along the query axis, as `pack_gqa` does for one token, and
the mask is repeated along it: the same attention, on the cache as it is. For the tiny model (6 query heads on 2
key/value heads) over a 1,300-token cache, 8 rows, float32, one thread: SDPA took 1.7 ms a layer for 9 tokens a
row packed, 3.5 ms with the repeat, which itself took 1 ms (a `/tmp` probe; docs/training.md, "Drafts").

Registered as an attention implementation (transformers' AttentionInterface), which a CPU backend sets on its
policy in place of "sdpa" (TransformersBackend). Anything but a short query without gradients on a CPU goes to
transformers' own SDPA: a prefill or a training pass (whose masks the packing would repeat), a query of one token,
no mask, and a GPU, where it was not measured.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "crr_packed_sdpa"
MAX_PACKED_QUERY = 64   # tokens a row: a decoding pass's block, never a prefill


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, width, dim = query.shape
    if (groups == 1 or not 1 < width <= MAX_PACKED_QUERY or attention_mask is None or attention_mask.shape[1] != 1
            or query.device.type != "cpu" or torch.is_grad_enabled() or dropout
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # query head h reads key/value head h // groups (repeat_kv's order): (heads, width) -> (kv heads, groups x width)
    packed = query.reshape(rows, heads // groups, groups * width, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, scale=scaling,
                                                           attn_mask=attention_mask.repeat(1, 1, groups, 1))
    return out.reshape(rows, heads, width, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)   # its masks are SDPA's (an unregistered name gets none)
