"""Prefix KV reuse across turns for the transformers backend.

A multi-turn rollout's next prompt is its previous prompt plus the action it generated plus the
observation, and a counterfactual branch's prompt is a prefix of its realised trajectory; re-encoding
that shared prefix every turn made prefill grow with the square of the turn count. The cache keeps, per
finished generation, the keys and values of every token the model was fed (the prompt and the action
up to its last token), and a new prompt reuses the longest cached prefix of itself: only the rest is
prefilled. (vLLM does the same with its automatic prefix caching; `model.generate` keeps a cache within
one call only, and a batch of rows with different cached lengths needs the left-aligned assembly below.)
Rows of one call that share a prefix the cache lacks (a task's G siblings at their first call, the system prompt
of a batch of tasks) have it encoded once, stored, then reused by each (TransformersBackend._share_prefixes).
Within a call, full-attention models decode into a DecodeCache, which grows in place and lets finished rows go.

Entries are per sequence, on the model's device, and bounded in bytes with least-recently-used eviction;
an entry that another one extends is dropped when the longer one is stored. Reused keys and values are
the same numbers a fresh prefill computes up to floating-point rounding (same positions, same masks).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of one sequence, (heads, tokens, dim)


@dataclass
class _Entry:
    ids: np.ndarray
    kv: KV
    nbytes: int


class PrefixCache:
    """Keys and values of earlier sequences, looked up by longest common token prefix."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0
        self.bytes = 0
        self.reused_tokens = 0   # prompt tokens taken from the cache (statistics for benchmarks)
        self.prefilled_tokens = 0  # prompt tokens the model had to encode

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[int, KV | None]:
        """(n, kv): the longest cached prefix of `ids`, at most len(ids) - 1 tokens (the last prompt token
        is always fed: its logits give the first action token); kv holds at least n tokens."""
        best_key, best = self._longest(ids)
        self.reused_tokens += best
        self.prefilled_tokens += len(ids) - best
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key].kv

    def cached(self, ids: list[int]) -> int:
        """How many tokens of `ids` `lookup` would reuse, without counting or touching anything."""
        return self._longest(ids)[1]

    def _longest(self, ids: list[int]) -> tuple[int | None, int]:
        query = np.asarray(ids, dtype=np.int64)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            n = min(len(entry.ids), len(query) - 1)
            if n <= best:
                continue
            differ = np.flatnonzero(entry.ids[:n] != query[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best:
                best_key, best = key, common
        return best_key, best

    def store(self, ids: list[int], kv: KV) -> None:
        """Keep the keys and values of `ids` (one per token); entries that `ids` extends are dropped."""
        if self.max_bytes <= 0:
            return
        key_ids = np.asarray(ids, dtype=np.int64)
        for key in [k for k, e in self._entries.items()
                    if len(e.ids) <= len(key_ids) and np.array_equal(e.ids, key_ids[:len(e.ids)])]:
            self._drop(key)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return
        while self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_key] = _Entry(key_ids, kv, nbytes)
        self._next_key += 1
        self.bytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes


class DecodeLayer(DynamicLayer):
    """A full-attention layer's keys and values in a buffer with room to grow: a decoding step writes its
    token in place. (transformers' DynamicLayer concatenates, copying the whole cache at every step, a cost
    that grows with the context.) `keys` and `values` are views of the filled part, so everything that reads
    a DynamicLayer reads this one."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room  # tokens to reserve at the first update
        self.filled = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.device, self.is_initialized = key_states.device, True
            self._k, self._v = (_with_room(x[:, :, :0], max(self.room, x.shape[2])) for x in (key_states, value_states))
        end = self.filled + key_states.shape[2]
        if end > self._k.shape[2]:  # out of room: double it (amortised, as a list grows)
            self._k, self._v = (_with_room(x, max(end, 2 * x.shape[2])) for x in (self._k, self._v))
        self._k[:, :, self.filled:end] = key_states
        self._v[:, :, self.filled:end] = value_states
        self.filled = end
        self._views()
        return self.keys, self.values

    def keep(self, rows: torch.Tensor, start: int) -> None:
        """Keep only the batch rows `rows`, and the columns from `start` on."""
        if self.is_initialized:
            rows = rows.to(self._k.device)
            self._k, self._v = self._k[rows, :, start:], self._v[rows, :, start:]
            self.filled -= start
            self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.filled], self._v[:, :, :self.filled]


def _with_room(buffer: torch.Tensor, tokens: int) -> torch.Tensor:
    """`buffer` (batch, heads, n, dim) extended along its token axis to `tokens` (the new part uninitialised)."""
    room = buffer.new_empty(buffer.shape[:2] + (tokens - buffer.shape[2],) + buffer.shape[3:])
    return torch.cat([buffer, room], dim=2)


class DecodeCache(DynamicCache):
    """A cache of DecodeLayers, one per decoder layer, from which finished rows and the columns that only
    they needed can be dropped between decoding steps (`keep`)."""

    def __init__(self, n_layers: int, room: int):
        Cache.__init__(self, layers=[DecodeLayer(room) for _ in range(n_layers)])

    def keep(self, rows: torch.Tensor, start: int) -> None:
        for layer in self.layers:
            layer.keep(rows, start)


def full_attention(config: PretrainedConfig) -> bool:
    """Whether every decoder layer attends to all earlier tokens (no sliding window, no recurrent state):
    the layers a DecodeCache can hold."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and not getattr(text, "sliding_window", None)


def batch_past(config: PretrainedConfig, rows: list[tuple[int, KV | None]], width: int,
               room: int) -> DynamicCache | None:
    """A batch cache `width` tokens wide holding each row's first n reused tokens right-aligned (the rest
    is padding, masked out by the caller's attention mask), with room for `room` tokens in all. For a
    full-attention model a DecodeCache (also when nothing is reused); otherwise transformers' own cache,
    or None when no row reuses anything."""
    decode = full_attention(config)
    if width == 0 and not decode:
        return None
    past = DecodeCache(config.get_text_config(decoder=True).num_hidden_layers, room) if decode else None
    if width == 0:
        return past
    template = next(kv for n, kv in rows if n)
    layers = []
    for layer, (k0, v0) in enumerate(template):
        keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(rows), v0.shape[0], width, v0.shape[2]))
        for i, (n, kv) in enumerate(rows):
            if n:
                keys[i, :, width - n:] = kv[layer][0][:, :n]
                values[i, :, width - n:] = kv[layer][1][:, :n]
        if past is not None:
            past.layers[layer].update(keys, values)
        else:
            layers.append((keys, values))
    return past if past is not None else DynamicCache(layers, config=config)


def keep_rows(past: DynamicCache, attention: torch.Tensor, rows: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """The batch cache and attention mask of `rows` only; a DecodeCache also drops the leading columns
    that are padding for every kept row (a finished long prompt's)."""
    index = torch.tensor(rows)
    attention = attention[index]
    if isinstance(past, DecodeCache):
        start = int(attention.any(0).to(torch.int8).argmax())
        past.keep(index, start)
        return past, attention[:, start:]
    past.batch_select_indices(index.to(past.layers[0].keys.device))
    return past, attention


def reusable(past: object, width: int) -> bool:
    """Whether `past` holds every fed token's keys and values in plain per-layer tensors (a dynamic cache
    of full-attention layers); sliding-window or recurrent layers keep less, and are not reused."""
    layers = getattr(past, "layers", None)
    return bool(layers) and all(getattr(layer, "keys", None) is not None and layer.keys.dim() == 4
                                and layer.keys.shape[-2] == width for layer in layers)


def row_kv(past: DynamicCache, row: int, keep: torch.Tensor) -> KV:
    """Row `row`'s keys and values at the positions `keep` (its unmasked tokens), as one sequence."""
    return [(layer.keys[row][:, keep].clone(), layer.values[row][:, keep].clone()) for layer in past.layers]
