"""What the model sees, and the token layout the trainer uses (paper: Preliminaries, the state s_t holds
the issue, the conversation history and the tool observations; Appendix "Prompt and Tool Catalogue").

A conversation is the system prompt (with the turn cap H), the user prompt (issue and working directory)
and the tools (TOOL_SCHEMAS) rendered by the tokenizer's chat template, then per step an assistant
message (the action a_t: one tool call) and a `tool` message (its observation, already truncated
deterministically by crr.agent.tools). It is kept twice, in lockstep: as chat messages, and as the
token stream a multi-turn GRPO trainer consumes (TRL's rollout_func: prompt_ids, completion_ids,
env_mask):

    prompt_ids       render(system, user; tools) + "<|im_start|>assistant\\n"
    completion_ids   a_0 | o_0 | a_1 | o_1 | ... | a_T
    env_mask         1 on action tokens (generated), 0 on observation tokens (the environment's)
    spans[t]         (start, end) of a_t in completion_ids

An action's ids are exactly what was generated: `<tool_call>\\n{...}\\n</tool_call><|im_end|>`. An
observation's ids are the chat-template rendering of the tool message plus the next assistant header,
computed as TRL's `_get_tool_suffix_ids` does (render a dummy conversation with and without the tool
message, cut at the end-of-turn token): `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
<|im_end|>\\n<|im_start|>assistant\\n`. An action cut off by the token budget has no end-of-turn token;
the observation then starts with one, so the stream still renders as a closed turn (mask 0: the model
did not emit it). The conversation ends with the last action: the final observation (submit, or the
turn cap) is never shown to the model.

Prefix consistency: `token_ids()` decodes to `render_text(messages)`, the chat template's text of the
whole conversation, always; and equals `render_ids(messages)`, the tokenizer's rendering of the whole
conversation, token for token whenever each action's ids are the tokenizer's own encoding of its text.
Every boundary between parts is a special token, so no merge crosses one. Sampled actions can be
tokenized differently from how the tokenizer would encode their text (the grammar forces structure in
pieces, and a model may spell "ab" as "a" + "b"); the stream keeps the sampled ids, which the
log-probabilities belong to. To train SFT on the tokens the constrained sampler emits, build each
action's ids with `ToolCallGrammar.tokenize(call_json)` and pass them to `add_action`.
"""

from __future__ import annotations

import copy
import json
import re
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from crr.agent.prompt import DEFAULT_MAX_TURNS, TOOL_SCHEMAS, agent_format
from crr.errors import CRRError

if TYPE_CHECKING:
    from crr.agent.tools import ToolCall
    from crr.tasks.schema import Task

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
INVALID_TOOL_NAME = "invalid_tool_call"  # the `name` of the tool message answering an unparsable call
# The exact shape the Qwen chat template renders for a tool call (and the grammar forces).
_CALL_SHAPE = re.compile(r'\{"name": "([A-Za-z_][A-Za-z0-9_]*)", "arguments": (\{.*\})\}', re.DOTALL)


def initial_messages(task: Task, workdir: str, max_turns: int = DEFAULT_MAX_TURNS,
                     format_name: str | None = None) -> list[dict]:
    """s_0's conversation: the format's system prompt with the turn cap (the paper's by default), and the
    issue. Render it with the same format's tools (`agent_format(format_name).tools`)."""
    fmt = agent_format(format_name)
    return [{"role": "system", "content": fmt.system_prompt(max_turns)},
            {"role": "user", "content": fmt.user_prompt(task, workdir)}]


def action_text(call: ToolCall, tools: list[dict] | None = None) -> str:
    """A call's JSON as the model emits it: the chat template's shape, arguments in schema order (as the
    grammar forces them), json.dumps separators; for scripted actions (the expert, SFT data)."""
    tools = TOOL_SCHEMAS if tools is None else tools
    order = next((list(t["function"]["parameters"]["properties"]) for t in tools
                  if t["function"]["name"] == call.name), [])
    args = {k: call.arguments[k] for k in order if k in call.arguments}
    args.update((k, v) for k, v in call.arguments.items() if k not in args)
    return json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False)


def call_json(call_text: str) -> str:
    """The JSON of a call from its decoded action text without end-of-turn (the tool-call wrapper removed)."""
    return call_text.removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE)


def action_message(call_json_text: str) -> dict:
    """The assistant message of an action, given the call's JSON as generated.

    A call of the template's shape becomes a structured tool call whose `arguments` is the generated
    JSON text verbatim (the template prints a string as is), so the rendering reproduces the generated
    text byte for byte, escapes included. Anything else (a truncated or malformed call) becomes the
    raw text `<tool_call>\\n...`, which renders the same way.
    """
    m = _CALL_SHAPE.fullmatch(call_json_text)
    if m:
        try:
            json.loads(m[2])
        except json.JSONDecodeError:
            m = None
    if m is None:
        return {"role": "assistant", "content": TOOL_CALL_OPEN + call_json_text}
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": m[1], "arguments": m[2]}}]}


def observation_message(text: str, tool_name: str | None) -> dict:
    """The `tool` message of an observation; `tool_name` None for an unparsable call."""
    return {"role": "tool", "name": tool_name or INVALID_TOOL_NAME, "content": text}


def _assistant_text(message: dict) -> str:
    """The text the template renders inside an assistant turn (between the header and <|im_end|>)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return message.get("content") or ""
    fn = calls[0]["function"]
    args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}{{"name": "{fn["name"]}", "arguments": {args}}}{TOOL_CALL_CLOSE}'


class Conversation:
    """A conversation as messages and as the trainer's token stream, built incrementally.

        conv = Conversation(tokenizer, initial_messages(task, sandbox.repo_dir, max_turns=50))
        conv.add_action(sample.text, sample.action_ids)        # a_t as generated
        conv.add_observation(obs.text, call.name)              # o_t (not after the last action)
        conv.prompt_ids, conv.completion_ids, conv.env_mask, conv.spans
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None):
        if tokenizer.eos_token_id is None:
            raise CRRError("the tokenizer has no eos (end-of-turn) token; the token layout needs one")
        if not messages or messages[-1]["role"] != "user":
            raise CRRError("a conversation starts with its system and user messages (see initial_messages)")
        self.tokenizer = tokenizer
        self.tools = TOOL_SCHEMAS if tools is None else tools
        self.messages: list[dict] = copy.deepcopy(messages)
        self.n_initial = len(messages)
        self.prompt_ids: list[int] = render_ids(tokenizer, self.messages, self.tools)
        self.completion_ids: list[int] = []
        self.env_mask: list[int] = []
        self.spans: list[tuple[int, int]] = []

    @property
    def expects(self) -> str:
        """The role of the next message: "assistant" or "tool"."""
        return "tool" if self.messages[-1]["role"] == "assistant" else "assistant"

    def add_action(self, call_json_text: str, action_ids: list[int] | None = None) -> None:
        """Append a_t: its call JSON as generated and its generated ids (`<tool_call>...<|im_end|>`; no
        end-of-turn if truncated). Without ids, the tokenizer's encoding of the rendered action is used
        (what a chat-template SFT trains on)."""
        if self.expects != "assistant":
            raise CRRError("an action must follow the prompt or an observation; add the observation first")
        message = action_message(call_json_text)
        if action_ids is None:
            action_ids = self.tokenizer.encode(_assistant_text(message), add_special_tokens=False)
            action_ids.append(self.tokenizer.eos_token_id)
        elif not action_ids:
            raise CRRError("an action needs at least one token")
        self.messages.append(message)
        start = len(self.completion_ids)
        self.completion_ids += action_ids
        self.env_mask += [1] * len(action_ids)
        self.spans.append((start, len(self.completion_ids)))

    def add_observation(self, text: str, tool_name: str | None) -> list[int]:
        """Append o_t (the tool message plus the next assistant header); returns its ids."""
        if self.expects != "tool":
            raise CRRError("an observation must follow an action")
        message = observation_message(text, tool_name)
        closed = self.completion_ids[-1] == self.tokenizer.eos_token_id
        ids = ([] if closed else [self.tokenizer.eos_token_id]) + observation_ids(self.tokenizer, message, self.tools)
        self.messages.append(message)
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        return ids

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def context_ids(self, t: int) -> list[int]:
        """The tokens the policy conditions on for a_t: the prompt and everything before a_t."""
        if not 0 <= t <= len(self.spans):
            raise CRRError(f"step {t} is outside this conversation's {len(self.spans)} actions")
        end = self.spans[t][0] if t < len(self.spans) else len(self.completion_ids)
        return self.prompt_ids + self.completion_ids[:end]

    def messages_at(self, t: int) -> list[dict]:
        """The messages the policy sees before a_t (for rendering, or to restart generation at s_t)."""
        if not 0 <= t <= len(self.spans):
            raise CRRError(f"step {t} is outside this conversation's {len(self.spans)} actions")
        return copy.deepcopy(self.messages[:self.n_initial + 2 * t])


def render_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The tokenizer's rendering of a whole conversation: ending with a `user`/`tool` message, with the
    next assistant header; ending with an action, cut right after its end-of-turn token."""
    tools = TOOL_SCHEMAS if tools is None else tools
    ends_with_action = messages[-1]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=not ends_with_action,
                                        tokenize=True, return_dict=False)
    if ends_with_action:
        ids = ids[:_last_eos(tokenizer, ids) + 1]
    return list(ids)


def render_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template's text of a whole conversation (cut as in `render_ids`)."""
    tools = TOOL_SCHEMAS if tools is None else tools
    ends_with_action = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=not ends_with_action,
                                         tokenize=False)
    if ends_with_action:
        text = text[:text.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)]
    return text


def observation_ids(tokenizer: PreTrainedTokenizerBase, message: dict, tools: list[dict] | None = None) -> list[int]:
    """Ids of a tool message plus the next assistant header, as TRL's `_get_tool_suffix_ids` computes
    them: render a dummy exchange without and with the message and take the difference."""
    tools = TOOL_SCHEMAS if tools is None else tools
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": message["name"], "arguments": {}}}]}]
    prefix = tokenizer.apply_chat_template(dummy, tools=tools, tokenize=True, return_dict=False)
    prefix = prefix[:_last_eos(tokenizer, prefix) + 1]
    full = tokenizer.apply_chat_template(dummy + [message], tools=tools, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    if list(full[:len(prefix)]) != list(prefix):
        raise CRRError("this chat template is not prefix-preserving around tool messages; crr needs one "
                       "that is (e.g. the Qwen3 templates TRL ships)")
    return list(full[len(prefix):])


def _last_eos(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> int:
    positions = [i for i, tok in enumerate(ids) if tok == tokenizer.eos_token_id]
    if not positions:
        raise CRRError("the chat template renders no end-of-turn (eos) token; crr needs one that does")
    return positions[-1]
