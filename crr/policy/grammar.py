"""Token-level JSON grammar for tool calls (paper: Appendix "Prompt and Tool Catalogue": "a JSON-grammar
decoder that rejects malformed structured outputs at the token level").

An action is exactly what the Qwen chat template renders for an assistant tool call:

    <tool_call>\\n{"name": "view_file", "arguments": {"path": "a.py", "start": 1}}\\n</tool_call><|im_end|>

with the JSON compiled from TOOL_SCHEMAS (anyOf over the tools' {"name": const, "arguments": {...}}),
properties in schema order and json.dumps separators, so a sampled call re-renders to the same text.

Built on xgrammar: it is vLLM's default structured-output backend (the GPU path constrains with the
same compiled schema), has a CPU mask path, and installs beside torch 2.13 without touching it.

Where the grammar leaves exactly one continuation string (xgrammar's jump-forward string: the
`{"name": "` opening, `", "arguments": {"path": "` between fields, the closing `}}\\n</tool_call>`),
the matcher forces that string's canonical tokenization one token at a time, so structure always
tokenizes as the chat template would render it. Those positions have a one-token mask: zero entropy,
and they are not semantic tokens.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from crr.agent.prompt import TOOL_SCHEMAS
from crr.errors import CRRError

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
_JSON_STRING = 'basic_string ::= (("\\"" basic_string_sub))'  # xgrammar's rule for a free JSON string
# xgrammar's characters of a string with a minLength: no escape at all (so no quote or newline in a command)
_MIN_LENGTH_CHARS = '_characters ::= (([^\\"\\\\\\r\\n]))'
_JSON_CHAR = '(([^\\0-\\x1f\\"\\\\\\r\\n]) | ("\\\\" basic_escape))'  # one character of basic_string_sub

# Arguments the tools reject when empty (crr.agent.tools: "path is empty", "command is empty"). The decoder
# does not offer the empty string for them: a policy that has learned a call's name before its argument
# would otherwise close the string at once and loop on the error (docs/multi-tier.md, the first attempt).
NON_EMPTY_ARGUMENTS = ("path", "command")


def tool_call_schema(tools: list[dict], max_value_chars: int | None = None) -> dict:
    """JSON schema of one call: anyOf over the tools. `max_value_chars` also bounds every integer
    without a maximum to that many digits (strings are bounded in the grammar, see ToolCallGrammar)."""
    cases = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = copy.deepcopy(fn.get("parameters") or {"type": "object", "properties": {}})
        for name in NON_EMPTY_ARGUMENTS:
            if params.get("properties", {}).get(name, {}).get("type") == "string":
                params["properties"][name]["minLength"] = 1
        if max_value_chars is not None:
            for prop in params.get("properties", {}).values():
                if prop.get("type") == "integer" and "maximum" not in prop:
                    # xgrammar's integer bounds are int64: more than 18 digits would overflow them
                    prop["maximum"] = 10 ** min(max_value_chars, 18) - 1
        cases.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": cases}


def _bit(token_id: int) -> tuple[int, np.int32]:
    """Word index and int32 word value of a token's bit in an xgrammar bitmask (bit 31 included)."""
    return token_id // 32, np.uint32(1 << (token_id % 32)).view(np.int32)


class ToolCallGrammar:
    """The compiled tool-call grammar for one tokenizer; `matcher()` gives per-sequence matchers.

    `vocab_size` is the model's logit width (it can exceed len(tokenizer)). `max_value_chars` bounds
    every free string to that many characters (an escape counts as one) and every unbounded integer to
    that many digits, so a call always fits a known token budget; the default leaves values unbounded
    as the schema says. Bounded strings are slower to mask (xgrammar does not precompute their masks),
    so keep the bound for smoke runs and tests of untrained models.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None = None,
                 vocab_size: int | None = None, max_value_chars: int | None = None):
        tools = TOOL_SCHEMAS if tools is None else tools
        if tokenizer.eos_token_id is None:
            raise CRRError("the tokenizer has no eos token; the grammar ends a call with it")
        if max_value_chars is not None and max_value_chars < 1:
            raise CRRError(f"max_value_chars must be at least 1, got {max_value_chars}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.schema = tool_call_schema(tools, max_value_chars)
        json_grammar = _with_escapes_in_min_length_strings(str(xgr.Grammar.from_json_schema(
            self.schema, any_whitespace=False, separators=(", ", ": "))), self.schema, max_value_chars)
        if max_value_chars is not None:
            if _JSON_STRING not in json_grammar:
                raise CRRError("this xgrammar version names JSON strings differently; cannot bound them")
            json_grammar = json_grammar.replace(_JSON_STRING, (
                f'basic_string ::= (("\\"" bounded_char{{0, {max_value_chars}}} "\\""))\n'
                'bounded_char ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape))'))
        grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(TOOL_CALL_OPEN)}"),
                                     xgr.Grammar.from_ebnf(json_grammar),
                                     xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(TOOL_CALL_CLOSE)}"))
        self.ebnf = str(grammar)  # the same grammar for vLLM's guided decoding
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=[self.eos_token_id])
        self._compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar)
        self.token_bytes: list[bytes] = info.decoded_vocab
        self._token_ids: dict[bytes, int] = {}  # token bytes -> id of the free positions, for tokenize()
        for token_id, piece in enumerate(self.token_bytes):
            if piece and token_id not in tokenizer.added_tokens_decoder:
                self._token_ids.setdefault(piece, token_id)
        self._max_piece = max(map(len, self._token_ids))
        # xgrammar treats added tokens (<|im_start|>, <tool_call>, ...) as text; inside a JSON value they
        # would break the chat format and tool-call parsers, so the free positions never allow them (the
        # forced wrapper does not go through this mask). The eos is xgrammar's stop token, allowed only
        # once the call is complete.
        self._keep = np.full(xgr.get_bitmask_shape(1, self.vocab_size)[1], -1, dtype=np.int32)
        for token_id in tokenizer.added_tokens_decoder:
            if token_id != self.eos_token_id and token_id < self.vocab_size:
                word, bit = _bit(token_id)
                self._keep[word] &= ~bit
        self._keep_t = torch.from_numpy(self._keep)

    def matcher(self) -> ToolCallMatcher:
        return ToolCallMatcher(self)

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize(self, call_json: str) -> list[int] | None:
        """Action tokens this grammar's sampler can emit for `call_json` (the forced tokenization of
        structure, the longest allowed token elsewhere), or None if the grammar does not accept it."""
        matcher, rest, ids = self.matcher(), (TOOL_CALL_OPEN + call_json + TOOL_CALL_CLOSE).encode(), []
        while rest:
            token_id = matcher.forced_token
            if token_id is None:
                allowed = matcher.allowed()
                token_id = next((i for n in range(min(self._max_piece, len(rest)), 0, -1)
                                 if (i := self._token_ids.get(rest[:n])) is not None and allowed[i]), None)
            if token_id is None or not rest.startswith(self.token_bytes[token_id]):
                return None
            matcher.advance(token_id)
            ids.append(token_id)
            rest = rest[len(self.token_bytes[token_id]):]
        return ids + [self.eos_token_id] if matcher.allowed()[self.eos_token_id] else None

    def call_text(self, action_ids: list[int]) -> str:
        """The JSON of a call from its action tokens (the wrapper and eos removed; a truncated call
        gives its partial JSON)."""
        text = self.tokenizer.decode([t for t in action_ids if t != self.eos_token_id])
        text = text.removeprefix(TOOL_CALL_OPEN)
        return text.removesuffix(TOOL_CALL_CLOSE)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place (rows of logits = rows of bitmask)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1])


def _with_escapes_in_min_length_strings(json_grammar: str, schema: dict, max_value_chars: int | None) -> str:
    """xgrammar compiles a string with a minLength to characters without escapes; give them JSON's escapes
    back (a command needs its quotes and newlines), keeping the minimum."""
    wanted = sum("minLength" in prop for case in schema["anyOf"]
                 for prop in case["properties"]["arguments"].get("properties", {}).values())
    lines = json_grammar.splitlines()
    found = [i for i, line in enumerate(lines) if line.endswith(_MIN_LENGTH_CHARS)]
    if len(found) != wanted:
        raise CRRError(f"this xgrammar version compiles minLength strings differently ({len(found)} rules for "
                       f"{wanted} arguments); cannot keep their escapes")
    for i in found:
        lines[i] = lines[i].removesuffix(_MIN_LENGTH_CHARS) + "_characters ::= " + _JSON_CHAR
    # one character, then the rest as a free string: basic_string_sub's masks are precomputed (a repetition
    # of characters is masked at each token, 500x slower here); bounded strings: the rest is bounded_char's
    text, uses = "\n".join(lines), '_characters{1, -1} "\\""))'
    if text.count(uses) != wanted:
        raise CRRError(f"this xgrammar version uses minLength strings differently ({text.count(uses)} uses for "
                       f"{wanted} arguments); cannot keep their escapes")
    rest = "basic_string_sub" if max_value_chars is None else f'bounded_char{{0, {max_value_chars - 1}}} "\\""'
    return text.replace(uses, f"_characters {rest}))")


def _ebnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class ToolCallMatcher:
    """Grammar state of one sequence: the mask for its next token, advance, termination, reset.

    Also counts grammar rejections: a token step is a rejection when the token the unconstrained
    distribution would have chosen (same temperature, same random draw) is not allowed by the mask.
    """

    def __init__(self, grammar: ToolCallGrammar):
        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar._compiled)
        self._forced: list[int] = []
        self.tokens = 0
        self.rejections = 0
        self._jump_forward()

    def reset(self) -> None:
        self._matcher.reset()
        self.tokens = self.rejections = 0
        self._forced = []
        self._jump_forward()

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    @property
    def forced_token(self) -> int | None:
        """The next token when the grammar leaves one continuation string (its canonical first token)."""
        return self._forced[0] if self._forced else None

    @property
    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here on (the canonical tokenization of the string it leaves)."""
        return list(self._forced)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Write the allowed next tokens into row `index` of an xgrammar bitmask."""
        if self.is_terminated:
            raise CRRError("the tool call is complete; reset the matcher before asking for a next token")
        if self._forced:
            word, bit = _bit(self._forced[0])
            bitmask[index].zero_()
            bitmask[index, word] = int(bit)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index)
            bitmask[index] &= self.grammar._keep_t

    def allowed(self) -> torch.Tensor:
        """Boolean mask over the vocabulary of the allowed next tokens."""
        bitmask = self.grammar.allocate_bitmask(1)
        self.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, self.grammar.vocab_size)
        apply_bitmask(logits, bitmask)
        return torch.isfinite(logits[0])

    def advance(self, token_id: int, unconstrained_id: int | None = None) -> None:
        """Accept `token_id` (CRRError if the grammar does not allow it); `unconstrained_id` is the
        token the unconstrained distribution would have chosen, for the rejection count. At a forced
        position the mask allows only the canonical token, but any tokenization xgrammar accepts
        advances the state."""
        if not self._matcher.accept_token(token_id):
            raise CRRError(f"token {token_id} ({self.grammar.tokenizer.decode([token_id])!r}) is not "
                           "allowed by the tool-call grammar here")
        if self._forced:
            # Another tokenization of the forced string (scoring a vLLM sample) is grammatical too:
            # xgrammar accepted it, so the rest is re-derived from its state below.
            self._forced = self._forced[1:] if token_id == self._forced[0] else []
        self.tokens += 1
        if unconstrained_id is not None:
            self.count_rejection(token_id, unconstrained_id)
        if not self._forced:
            self._jump_forward()

    def count_rejection(self, token_id: int, unconstrained_id: int) -> None:
        """Count a grammar rejection at an accepted token: the unconstrained draw was another token."""
        self.rejections += int(unconstrained_id != token_id)

    def _jump_forward(self) -> None:
        if not self._matcher.is_terminated():
            forced_text = self._matcher.find_jump_forward_string()
            if forced_text:
                self._forced = self.grammar.encode(forced_text)
