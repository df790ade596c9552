"""SFT rows: a conversation as the token stream RL builds for it, with the ids the constrained sampler emits.

Shared by the expert's episodes (crr.sft.warm_start) and the synthetic curriculum (crr.sft.curriculum).
"""

from __future__ import annotations

import re
from itertools import groupby
from types import SimpleNamespace

from crr.agent.conversation import (
    INVALID_TOOL_NAME,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    Conversation,
    action_message,
    initial_messages,
)
from crr.agent.expert import call_json
from crr.agent.prompt import agent_format
from crr.agent.tools import ToolCall, truncate
from crr.errors import CRRError
from crr.policy.grammar import ToolCallGrammar


def scripted_messages(problem: str, calls: list[tuple[ToolCall, str | None]], max_turns: int) -> list[dict]:
    """A rendered (not played) conversation in the compact format: the issue, then each call with its
    observation (None: none follows, e.g. after the last call), for the synthetic curricula."""
    fmt = agent_format("compact")
    messages = initial_messages(SimpleNamespace(problem_statement=problem), "/testbed", max_turns, "compact")
    for call, observation in calls:
        messages.append(action_message(call_json(call)))
        if observation is not None:
            if fmt.obs_keep_chars is not None:
                observation = truncate(observation, fmt.obs_keep_chars)
            messages.append({"role": "tool", "name": call.name, "content": observation})
    return messages


def action_ids(grammar: ToolCallGrammar, call: str) -> list[int]:
    """The ids of an action (`<tool_call>\n{call}\n</tool_call>` and the end-of-turn) that the constrained
    sampler can emit, as close to the tokenizer's own encoding as the grammar allows: at a position where
    the grammar forces a token, that token, and the rest re-encoded from there."""
    tokenizer = grammar.tokenizer
    rest = (TOOL_CALL_OPEN + call + TOOL_CALL_CLOSE).encode()
    matcher, ids, plan = grammar.matcher(), [], []
    while rest:
        token = matcher.forced_token
        if token is None:
            plan = plan or tokenizer.encode(rest.decode(), add_special_tokens=False)
            token = plan.pop(0)
            if not matcher.allowed()[token]:  # never seen in practice; the grammar's own longest match
                allowed = matcher.allowed()
                token = max((i for i, piece in enumerate(grammar.token_bytes)
                             if piece and rest.startswith(piece) and allowed[i]),
                            key=lambda i: len(grammar.token_bytes[i]), default=None)
                plan = []
        else:
            plan = []  # the forced token moved the boundary: re-encode what follows it
        if token is None or not rest.startswith(grammar.token_bytes[token]):
            raise CRRError(f"the tool-call grammar does not accept {call[:80]!r}")
        matcher.advance(token)
        ids.append(token)
        rest = rest[len(grammar.token_bytes[token]):]
    if not matcher.allowed()[grammar.eos_token_id]:
        raise CRRError(f"the tool-call grammar does not accept {call[:80]!r} as a complete call")
    return ids + [grammar.eos_token_id]


def sft_row(grammar: ToolCallGrammar, messages: list[dict], tools: list[dict] | None = None) -> dict:
    """`input_ids` and `assistant_masks` of a conversation (system, user, then actions and observations,
    ending with an action), laid out by crr.agent.conversation with the sampler's action ids; `tools` is
    the catalogue it was rendered with (the paper's by default)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    conv = Conversation(grammar.tokenizer, messages[:first], tools)
    for message in messages[first:]:
        if message["role"] == "assistant":
            if not message.get("tool_calls"):
                raise CRRError("an SFT conversation holds parsed tool calls only, not raw assistant text")
            fn = message["tool_calls"][0]["function"]
            call = f'{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}'
            conv.add_action(call, action_ids(grammar, call))
        else:
            name = message.get("name")
            conv.add_observation(message["content"], None if name == INVALID_TOOL_NAME else name)
    return {"input_ids": conv.token_ids(), "assistant_masks": [0] * len(conv.prompt_ids) + conv.env_mask}


_ARGUMENT_KEY = re.compile(r'"(\w+)": "?$')  # the forced text before an argument's value (a string's quote)


def action_parts(grammar: ToolCallGrammar, ids: list[int], mask: list[int]) -> list[str | None]:
    """The part of the call each token of a row writes: "tool" (the tool's name) or an argument's key (path,
    start, end, replacement, command, ...); None outside the actions (mask 0) and where the grammar forces
    the token (braces, keys, quotes, the end of turn), which a constrained sampler cannot get wrong."""
    parts: list[str | None] = [None] * len(ids)
    start = 0
    while start < len(ids):
        if not mask[start]:
            start += 1
            continue
        end = start
        while end < len(ids) and mask[end]:
            end += 1
        matcher, text, part = grammar.matcher(), "", "tool"
        for k in range(start, end - 1):  # the end-of-turn token closes the call: structure
            forced = matcher.forced_token is not None
            if not forced:
                parts[k] = part
            matcher.advance(ids[k])
            text += grammar.token_bytes[ids[k]].decode("utf-8", errors="replace")
            if forced and (key := _ARGUMENT_KEY.search(text)):
                part = "tool" if key[1] == "name" else key[1]
        start = end
    return parts


def part_spans(parts: list[str | None], part: str) -> list[list[int]]:
    """The runs of consecutive positions whose `action_parts` label is `part` (one per call that writes it)."""
    runs = groupby(range(len(parts)), key=lambda k: parts[k] == part)
    return [list(run) for is_part, run in runs if is_part]
