"""crr's tool-call grammar inside vLLM: a vLLM (V1) logits processor that masks each request's logits
with a crr.policy.grammar.ToolCallMatcher, so vLLM samples from exactly the distribution the
transformers backend samples from (crr.policy.backend's q: softmax(grammar-masked logits / T)).

Why not vLLM's own structured outputs (`StructuredOutputsParams(grammar=ToolCallGrammar.ebnf)`): that
mask is xgrammar's alone, and crr's mask differs from it in two ways. Where the grammar leaves one
continuation string, crr forces its canonical tokenization (one allowed token) while xgrammar allows
every tokenization of it; and inside JSON values crr disallows the tokenizer's added tokens
(<tool_call>, <|im_start|>, ...) which xgrammar treats as text. Measured on the shipped default at
T = 1.0, xgrammar's mask let vLLM emit such a token in 1 of 48 calls (7 tokens in 3 of 48 at T = 1.5),
and its behaviour log-probabilities then are not those of crr's q. With this processor they are.

A request opts in with `SamplingParams(extra_args={EXTRA_ARG: grammar_spec(...)})`; the processor is
given to vLLM as `LLM(logits_processors=[ToolCallLogitsProcessor])`, or for `vllm serve` as
`--logits-processors crr.policy.vllm_grammar:ToolCallLogitsProcessor` (the request then passes the spec
as `vllm_xargs`, see crr.policy.backend.VLLMServerBackend). It runs where vLLM's engine core runs (in
process or in its engine process) and builds each grammar there from the served model's tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from crr.policy.grammar import ToolCallGrammar, ToolCallMatcher, apply_bitmask

EXTRA_ARG = "crr_tool_call_grammar"


def grammar_spec(tools: list[dict], max_value_chars: int | None) -> str:
    """The request's grammar, as the string vLLM carries in `extra_args` (and `vllm_xargs` over HTTP). Key
    order is kept: the grammar emits a call's arguments in its schema's property order."""
    return json.dumps({"tools": tools, "max_value_chars": max_value_chars})


@dataclass
class _Request:
    matcher: ToolCallMatcher
    output_ids: list[int]   # vLLM's own list of the request's generated ids (a reference: it grows)
    consumed: int = 0       # how many of them the matcher has accepted


class ToolCallLogitsProcessor(LogitsProcessor):
    """Masks the rows of requests that carry EXTRA_ARG with their ToolCallMatcher's next-token mask.

    Not argmax-invariant: vLLM applies it before greedy and random sampling alike, and its
    processed_logprobs (logprobs_mode) then are log softmax(masked logits / T)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.tokenizer_name = vllm_config.model_config.tokenizer
        self.revision = vllm_config.model_config.tokenizer_revision
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self._tokenizer = None
        self._grammars: dict[str, ToolCallGrammar] = {}
        self._requests: dict[int, _Request] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        if spec is not None:
            try:
                parsed = json.loads(spec)
                if not isinstance(parsed, dict) or not isinstance(parsed.get("tools"), list):
                    raise TypeError("no tools list")
            except (TypeError, ValueError) as e:
                raise ValueError(f"extra_args[{EXTRA_ARG!r}] is not a grammar_spec string ({e})") from None

    def is_argmax_invariant(self) -> bool:
        return False

    def _grammar(self, spec: str) -> ToolCallGrammar:
        if spec not in self._grammars:
            if self._tokenizer is None:
                from transformers import AutoTokenizer
                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name, revision=self.revision)
            parsed = json.loads(spec)
            self._grammars[spec] = ToolCallGrammar(self._tokenizer, parsed["tools"], vocab_size=self.vocab_size,
                                                   max_value_chars=parsed["max_value_chars"])
        return self._grammars[spec]

    def _new_request(self, params: SamplingParams, _prompt_ids: list[int] | None,
                     output_ids: list[int]) -> _Request | None:
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        return None if spec is None else _Request(self._grammar(spec).matcher(), output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, self._new_request)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._requests:
            return logits
        grammar = next(iter(self._requests.values())).matcher.grammar
        bitmask = grammar.allocate_bitmask(logits.shape[0])  # all ones: rows without a grammar are untouched
        for index, request in self._requests.items():
            while request.consumed < len(request.output_ids):  # the tokens sampled since the last step
                request.matcher.advance(request.output_ids[request.consumed])
                request.consumed += 1
            if not request.matcher.is_terminated:  # (terminated: vLLM stops the request at the eos)
                request.matcher.fill_next_token_bitmask(bitmask, index)
        apply_bitmask(logits, bitmask)
        return logits


class WeightSyncExtension:
    """Mixed into vLLM's workers (`LLM(worker_extension_cls=...)`): `collective_rpc("crr_load_weights",
    args=(path,))` loads the weights in a safetensors file into the served model. A file, since tensors
    do not survive vLLM's worker IPC intact on every path (its shared-memory broadcast pickles them); for
    the models crr trains on CPU it is a few tens of MB."""

    def crr_load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        # the worker's reload (not model.load_weights): it redoes the post-load processing, e.g. the CPU
        # backend's repacking of linear weights, which leaves the loaded parameters empty
        self.reload_weights(weights_iterator=iter(load_file(path).items()))
        # A tied lm_head is not among the loaded layers, so its post-load processing is not redone; on CPU
        # that processing packs a copy of the (tied) weight for the logits GEMM, which would stay stale.
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and getattr(lm_head, "quant_method", None) is not None:
            lm_head.quant_method.process_weights_after_loading(lm_head)
