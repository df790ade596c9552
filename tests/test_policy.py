"""The policy: the tiny default model, its tokenizer and chat template under TRL, grammar-constrained
tool calls with per-token log-probabilities and entropy, and the CRR proposal's exclusion."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random

import jsonschema
import pytest
import torch
from forward_passes import passes_fed
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from typer.testing import CliRunner

from crr.agent.prompt import SYSTEM_PROMPT, TOOL_SCHEMAS
from crr.agent.tools import parse_tool_call
from crr.errors import CRRError
from crr.policy.backend import (
    DEFAULT_MAX_EXCLUSION_TRIES,
    SHARED_PREFIX_MIN_TOKENS,
    TransformersBackend,
    rejection_sample,
)
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import (
    MODEL_VERSION,
    SIZES,
    default_model_dir,
    frozen_base,
    init_tiny_model,
    load_policy,
    param_count,
    train_tokenizer,
)
from crr.policy.prefix_cache import DecodeLayer, PrefixCache
from crr.tasks.nano import Vocabulary, nano_template

MAX_VALUE_CHARS = 4
# Worst case for the longest call with 4-character values (every character its own token, escapes
# as \uXXXX) is about 100 tokens, so bounded calls always complete within this budget.
BUDGET = 128
_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
# The catalogue without descriptions: the same grammar, half the prompt (the tests' cost is prefill).
COMPACT_TOOLS = [{"type": "function", "function": {
    "name": t["function"]["name"],
    "parameters": {**t["function"]["parameters"], "properties": {
        k: {kk: vv for kk, vv in v.items() if kk != "description"}
        for k, v in t["function"]["parameters"]["properties"].items()}}}} for t in TOOL_SCHEMAS]


def conversation(issue: str = "Fix the off-by-one error in calc/core.py") -> list[dict]:
    return [{"role": "user", "content": issue}]




@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The default model, built on first use into a fresh crr cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CRR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        path = default_model_dir()
        assert path.name == f"tiny-{MODEL_VERSION}"
        mtime = (path / "model.safetensors").stat().st_mtime_ns
        assert default_model_dir() == path  # cached: not rebuilt
        assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    return path


@pytest.fixture(scope="session")
def policy(tiny_dir):
    return load_policy(tiny_dir)


@pytest.fixture(scope="session")
def backend(policy):
    return TransformersBackend(*policy, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)


@pytest.fixture(scope="session")
def batch():
    """Prompts of different lengths, so the batch is left-padded."""
    return [conversation(), conversation("x"), conversation("A longer issue: calc.add returns the wrong value " * 3),
            conversation()] * 2


@pytest.fixture(scope="session")
def samples(backend, batch):
    return backend.generate(batch, temperature=0.7, seed=7, max_new_tokens=BUDGET)


def teacher_forced(model, grammar, prompt_ids, action_ids, temperature):
    """Independent reference: one full forward pass, the grammar masks replayed by a fresh matcher."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + action_ids])).logits[0].float()
    matcher, behaviour, policy_lp, entropy = grammar.matcher(), [], [], []
    for k, token in enumerate(action_ids):
        row = logits[len(prompt_ids) + k - 1]
        masked = row.masked_fill(~matcher.allowed(), -math.inf)
        p = torch.softmax(masked, -1)
        behaviour.append(float(torch.log_softmax(masked / temperature, -1)[token]))
        policy_lp.append(float(torch.log_softmax(row, -1)[token]))
        entropy.append(float(-(p[p > 0] * p[p > 0].log()).sum()))
        matcher.advance(token)
    return behaviour, policy_lp, entropy


# ----------------------------------------------------------------------------- the model

def test_tiny_model_loads_offline_with_its_tokenizer(tiny_dir, policy):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3"
    assert 4_000_000 < param_count(model) < 5_000_000
    assert 4000 <= len(tokenizer) <= 8000 and model.config.vocab_size == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    call = '<tool_call>\n{"name": "submit_patch", "arguments": {}}\n</tool_call>'
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>") and tokenizer.decode(ids) == call
    assert tokenizer.decode(ids, skip_special_tokens=True) == call  # tool tags are not special: parsers see them
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    # the small size, counted without allocating weights
    with torch.device("meta"):
        small = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), tie_word_embeddings=True, **SIZES["small"]))
    assert 12_000_000 < param_count(small) < 15_000_000


def test_init_is_deterministic_per_seed_and_refuses_to_overwrite(tiny_dir, tmp_path):
    runner = CliRunner()
    from crr.cli import app

    result = runner.invoke(app, ["model", "init", "--out", str(tmp_path / "again"), "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert "4,4" in result.output and "parameters" in result.output and "vocab 6,1" in result.output
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = init_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    result = runner.invoke(app, ["model", "init", "--out", str(tmp_path / "again")])
    assert result.exit_code == 2 and "not an empty directory" in result.output
    with pytest.raises(CRRError, match="unknown model size"):
        init_tiny_model(tmp_path / "x", size="huge")
    with pytest.raises(CRRError, match="missing: no such directory; pass a model directory or a hub id"):
        load_policy(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CRRError, match="empty: that directory holds no model"):
        load_policy(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")   # no tokenizer, no weights
    with pytest.raises(CRRError, match="cannot load a model") as e:
        load_policy(tmp_path / "empty")
    assert "\n" not in str(e.value)   # transformers' several-line reason, on one line


def test_chat_template_renders_tool_turns_and_trl_keeps_it(policy, tmp_path):
    import trl.chat_template_utils as ctu
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = policy
    call = {"type": "function", "function": {"name": "view_file", "arguments": {"path": "calc/core.py", "start": 3}}}
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *conversation(),
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "view_file", "content": "   3\tdef add(a, b):"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, tokenize=False, add_generation_prompt=True)
    assert SYSTEM_PROMPT in text and '"name": "edit_file"' in text  # the tool catalogue
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "view_file", "arguments": {"path": "calc/core.py", '
            '"start": 3}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n   3\tdef add(a, b):\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # TRL recognises it: tool calling, prefix preservation, its response parser, its training variant
    assert ctu.supports_tool_calling(tokenizer) and ctu.is_chat_template_prefix_preserving(tokenizer)
    assert tokenizer.response_template is not None  # saved with the tokenizer
    assert ctu.get_training_chat_template(tokenizer) == ctu.qwen3_instruct_2507_training_chat_template
    parsed = tokenizer.parse_response('<tool_call>\n{"name": "view_file", "arguments": {"path": "a.py"}}\n'
                                      "</tool_call><|im_end|>", prefix="")
    assert parsed["tool_calls"][0]["function"] == {"name": "view_file", "arguments": {"path": "a.py"}}

    def view_file(path: str) -> str:
        """Show a file.

        Args:
            path: the file
        """
        return path

    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=8, use_cpu=True, bf16=False, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": [conversation()] * 2}),
                          processing_class=tokenizer, tools=[view_file])
    assert trainer.chat_template is None  # prefix-preserving: TRL did not swap in a training template


# ----------------------------------------------------------------------------- constrained generation

def test_every_sampled_call_is_a_valid_call(samples, backend, policy):
    _, tokenizer = policy
    names = set()
    for s in samples:
        assert not s.truncated
        call = json.loads(s.text)
        assert list(call) == ["name", "arguments"]
        jsonschema.validate(call["arguments"], _BY_NAME[call["name"]])  # independent of the grammar
        assert parse_tool_call(s.text).name == call["name"]
        names.add(call["name"])
        # the action is exactly what the chat template renders for this call
        rendered = tokenizer.apply_chat_template(
            [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}],
            tokenize=False)
        if "\\" not in s.text:  # tojson may spell escapes differently
            assert rendered == f"<|im_start|>assistant\n{tokenizer.decode(s.action_ids)}\n"
        assert s.action_ids[-1] == tokenizer.eos_token_id
        retokenized = backend.grammar.tokenize(s.text)  # a tokenization the sampler can emit
        assert tokenizer.decode(retokenized) == tokenizer.decode(s.action_ids)
    assert len(names) >= 2


def test_unbounded_grammar_calls_parse_or_are_flagged_truncated(policy):
    backend = TransformersBackend(*policy, tools=COMPACT_TOOLS)  # the schema's own (unbounded) strings
    samples = backend.generate([conversation()] * 8, temperature=0.6, seed=0, max_new_tokens=24)
    for s in samples:
        if s.truncated:
            assert len(s.action_ids) == 24 and s.action_ids[-1] != policy[1].eos_token_id
        else:
            parse_tool_call(s.text)
    assert any(not s.truncated for s in samples)


def test_the_grammar_refuses_an_empty_path_or_command_and_keeps_their_escapes(policy):
    # the tools reject them ("command is empty"); a policy that learned run_shell before its command
    # looped on that error (docs/multi-tier.md). Other strings may still be empty.
    def call(name, **arguments):
        return json.dumps({"name": name, "arguments": arguments})
    for bound in (None, 10):
        grammar = ToolCallGrammar(policy[1], COMPACT_TOOLS, max_value_chars=bound)
        assert grammar.tokenize(call("run_shell", command="")) is None
        assert grammar.tokenize(call("view_file", path="")) is None
        assert grammar.tokenize(call("edit_file", path="", start=1, end=1, replacement="x")) is None
        assert grammar.tokenize(call("edit_file", path="a.py", start=1, end=1, replacement="")) is not None
        assert grammar.tokenize(call("run_tests", test_filter="")) is not None
        assert grammar.tokenize(call("run_shell", command='grep "f"\nl')) is not None  # 10 characters, escaped
        assert grammar.tokenize(call("view_file", path="x")) is not None
    assert grammar.tokenize(call("run_shell", command='grep "f"\nls')) is None  # 11 > the bound


def test_a_large_value_bound_keeps_integers_within_int64(policy):
    # 24 characters a value: integer bounds stop at 18 digits (xgrammar's int64) instead of overflowing
    grammar = ToolCallGrammar(policy[1], COMPACT_TOOLS, max_value_chars=24)
    long_line = "x = 1  # " + "y" * 15
    call = json.dumps({"name": "edit_file", "arguments": {"path": "a.py", "start": 123456789012345678, "end": 1,
                                                          "replacement": long_line}})
    assert grammar.tokenize(call) is not None
    assert grammar.tokenize(call.replace("123456789012345678", "1234567890123456789")) is None


def test_greedy_is_deterministic_and_counts_rejections(backend, policy):
    a = backend.generate([conversation()] * 2, temperature=0.0, seed=0, max_new_tokens=BUDGET)
    b = backend.generate([conversation()], temperature=0.0, seed=99, max_new_tokens=BUDGET)
    assert a[0].action_ids == a[1].action_ids == b[0].action_ids
    assert all(lp == 0.0 for lp in a[0].behaviour_logprobs) and a[0].proposal_logprob == 0.0
    # greedy: a token is a rejection exactly when the raw argmax is outside the grammar's mask
    s, matcher = a[0], backend.grammar.matcher()
    with torch.no_grad():
        logits = policy[0](input_ids=torch.tensor([s.prompt_ids + s.action_ids])).logits[0]
    rejected = 0
    for k, token in enumerate(s.action_ids):
        allowed = matcher.allowed()
        argmax = int(logits[len(s.prompt_ids) + k - 1].argmax())
        assert token == (argmax if allowed[argmax] else int(logits[len(s.prompt_ids) + k - 1]
                                                             .masked_fill(~allowed, -math.inf).argmax()))
        rejected += not allowed[argmax]
        matcher.advance(token)
    assert s.grammar_rejections == rejected > 0
    assert matcher.is_terminated and matcher.rejections == 0  # no unconstrained ids given: nothing counted
    matcher.reset()
    assert not matcher.is_terminated and matcher.tokens == 0
    assert matcher.forced_token == policy[1].convert_tokens_to_ids("<tool_call>")


def test_sampling_is_reproducible_for_a_seed_and_varies_across_seeds(samples, backend, batch):
    # each from an empty cache: cached prefixes (what other tests left, in whatever order they ran) make the
    # numbers equal up to rounding only
    drawn = []
    for _ in range(2):
        backend.clear_cache()
        drawn.append(backend.generate(batch, temperature=0.7, seed=7, max_new_tokens=BUDGET))
    first, again = ([(s.action_ids, s.behaviour_logprobs, s.entropies) for s in d] for d in drawn)
    assert again == first
    other = backend.generate(batch, temperature=0.7, seed=8, max_new_tokens=BUDGET)
    assert [s.action_ids for s in other] != [s.action_ids for s in samples]
    assert samples[0].action_ids != samples[3].action_ids or samples[0].action_ids != samples[4].action_ids


def test_entropy_is_zero_on_forced_tokens_and_H_t_averages_semantic_tokens(samples, backend):
    for s in samples:
        matcher = backend.grammar.matcher()
        for token, h, semantic in zip(s.action_ids, s.entropies, s.semantic):
            assert semantic == (int(matcher.allowed().sum()) > 1)
            if not semantic:
                assert h == 0.0
            matcher.advance(token)
        assert not s.semantic[0] and not s.semantic[-1]  # <tool_call> and the eos are forced
        semantic_h = [h for h, sem in zip(s.entropies, s.semantic) if sem]
        assert semantic_h and s.entropy == pytest.approx(sum(semantic_h) / len(semantic_h))
        assert s.entropy > 0
        assert 0 <= s.grammar_rejections <= len(s.action_ids)


def test_logprobs_match_a_teacher_forced_pass(samples, backend, policy):
    model, _ = policy
    for s in samples[:4]:  # four prompt lengths: left padding in the batch
        behaviour, policy_lp, entropy = teacher_forced(model, backend.grammar, s.prompt_ids, s.action_ids, 0.7)
        assert s.behaviour_logprobs == pytest.approx(behaviour, abs=1e-4)
        assert s.policy_logprobs == pytest.approx(policy_lp, abs=1e-4)
        assert s.entropies == pytest.approx(entropy, abs=1e-4)
        assert s.proposal_logprob == pytest.approx(sum(behaviour), abs=1e-3)


def _assert_same_samples(fresh, reused):
    for a, b in zip(fresh, reused, strict=True):
        assert a.action_ids == b.action_ids
        assert b.policy_logprobs == pytest.approx(a.policy_logprobs, abs=1e-4)
        assert b.behaviour_logprobs == pytest.approx(a.behaviour_logprobs, abs=1e-4)
        assert b.entropies == pytest.approx(a.entropies, abs=1e-4)


def test_prefix_reuse_across_turns_matches_a_fresh_prefill(policy):
    """Turns that extend earlier prompts, a branch from inside a cached conversation beside a row the cache
    never saw, and weights changed in place: with the prefix cache every row samples what a fresh prefill
    samples, with the same numbers."""
    model, tokenizer = copy.deepcopy(policy[0]), policy[1]  # its weights are changed below
    fresh = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS,
                                prefix_cache_bytes=0)
    reuse = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    observation = tokenizer.encode("\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
    prompts = [fresh.prompt_ids(c) for c in (conversation(), conversation("x " * 40))]
    for turn in range(3):
        samples = fresh.generate(prompts, temperature=0.7, seed=turn, max_new_tokens=BUDGET)
        _assert_same_samples(samples, reuse.generate(prompts, temperature=0.7, seed=turn, max_new_tokens=BUDGET))
        prompts = [p + s.action_ids + observation for p, s in zip(prompts, samples)]
    cache = reuse.prefix_cache
    assert cache.reused_tokens > cache.prefilled_tokens and fresh.prefix_cache.reused_tokens == 0
    assert len(cache) == 2  # each turn's entry replaced the one it extends

    branch = [prompts[0][:-len(observation) - 3], fresh.prompt_ids(conversation("new"))]
    before = cache.reused_tokens
    _assert_same_samples(fresh.generate(branch, temperature=0.7, seed=9, max_new_tokens=BUDGET),
                         reuse.generate(branch, temperature=0.7, seed=9, max_new_tokens=BUDGET))
    # all but the last token of the branch, and the new row's system prompt and tools (every prompt's opening)
    shared = next(i for i, (a, b) in enumerate(zip(branch[0], branch[1])) if a != b)
    assert cache.reused_tokens - before == len(branch[0]) - 1 + shared

    # a prompt that shares no token with the cache (raw ids) beside one that reuses almost all of itself
    lone = [tokenizer.encode("zebra crossing"), prompts[1]]
    _assert_same_samples(fresh.generate(lone, temperature=0.7, seed=4, max_new_tokens=BUDGET),
                         reuse.generate(lone, temperature=0.7, seed=4, max_new_tokens=BUDGET))

    with torch.no_grad():  # an optimizer step, in effect: the cached keys and values are stale now
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    _assert_same_samples(fresh.generate(prompts, temperature=0.0, seed=0, max_new_tokens=BUDGET),
                         reuse.generate(prompts, temperature=0.0, seed=0, max_new_tokens=BUDGET))


def test_what_rows_share_is_encoded_once_and_samples_what_a_fresh_prefill_samples(policy):
    """A first call of G siblings of two tasks: the prefix both prompts open with is encoded once, then each
    prompt once, and the batch's prefill feeds each row its last prompt token and the call's opening; every row
    samples what it samples without a prefix cache, with the same numbers."""
    model, tokenizer = policy
    fresh = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS,
                                prefix_cache_bytes=0)
    shared = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    tasks = [fresh.prompt_ids(conversation(issue)) for issue in
             ("Fix the off-by-one error in calc/core.py " * 6, "The parser drops the last field of a row " * 6)]
    prompts = [p for p in tasks for _ in range(3)]
    common = next(k for k, (a, b) in enumerate(zip(*tasks)) if a != b)
    assert common >= SHARED_PREFIX_MIN_TOKENS and min(map(len, tasks)) - common >= SHARED_PREFIX_MIN_TOKENS
    with passes_fed(model) as fed:
        samples = shared.generate(prompts, temperature=1.0, seed=5, max_new_tokens=BUDGET)
    _assert_same_samples(fresh.generate(prompts, temperature=1.0, seed=5, max_new_tokens=BUDGET), samples)
    opening = len(shared.grammar.matcher()._forced)   # the tokens every call opens with, fed with the prompts
    assert fed[:3] == [(1, common), (2, max(len(p) - 1 for p in tasks) - common), (len(prompts), 1 + opening)]
    assert shared.prefix_cache.prefilled_tokens == sum(len(p) - 1 for p in tasks) - common + len(prompts)
    # nothing is shared twice: the next call of the same prompts feeds each row its last token only
    with passes_fed(model) as fed:
        again = shared.generate(prompts, temperature=1.0, seed=6, max_new_tokens=BUDGET)
    assert fed[0] == (len(prompts), 1 + opening)
    _assert_same_samples(fresh.generate(prompts, temperature=1.0, seed=6, max_new_tokens=BUDGET), again)


def test_a_lora_policy_decodes_from_its_merged_weights_in_float32_and_their_updates(tiny_dir, batch):
    """A float32 LoRA policy decodes from a merged copy (no adapter layers in it), which computes the adapter's
    function: every sample's log-probabilities are the LoRA model's own (a teacher-forced pass through the
    adapter), before and after the adapter's weights change in place: by an in-place update, and by fused AdamW
    steps (which bump no version counter) followed by the clear_cache every rollout starts with. On a CPU a bf16
    one decodes from a float32 merged copy."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    base, tokenizer = load_policy(tiny_dir)   # (not a copy of the session's: TRL may have patched its forward)
    assert base.dtype == torch.float32
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM",
                                            init_lora_weights=False))   # B != 0: the adapter changes the policy
    merged = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    optimizer = torch.optim.AdamW(lora, lr=0.05, fused=True)   # transformers' default: it bumps no version counter
    for update in range(3):
        samples = merged.generate(batch[:3], temperature=0.7, seed=update, max_new_tokens=BUDGET)
        for s in samples:
            behaviour, policy_lp, entropy = teacher_forced(model, merged.grammar, s.prompt_ids, s.action_ids, 0.7)
            assert s.behaviour_logprobs == pytest.approx(behaviour, abs=1e-4)
            assert s.policy_logprobs == pytest.approx(policy_lp, abs=1e-4)
            assert s.entropies == pytest.approx(entropy, abs=1e-4)
        if update == 0:   # a LoRA update in place
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, LoraLayer):
                        module.lora_B["default"].weight.add_(0.05)
        else:             # an optimizer step, then the next rollout's clear_cache
            for p in lora:
                p.grad = torch.ones_like(p)
            optimizer.step()
            merged.clear_cache()
    assert merged._merged is not None and not any(isinstance(m, LoraLayer) for m in merged._merged.modules())

    # on a CPU a bf16 one too, in float32: it samples the policy its bf16 weights and float32 adapter define,
    # which a float32 forward of the same weights computes (and the loss's bf16 forward approximates)
    bf16 = get_peft_model(load_policy(tiny_dir, dtype=torch.bfloat16)[0],
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM",
                                     init_lora_weights=False))
    decoder = TransformersBackend(bf16, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    exact = copy.deepcopy(bf16).float()
    for s in decoder.generate(batch[:3], temperature=0.7, seed=0, max_new_tokens=BUDGET):
        behaviour, policy_lp, _ = teacher_forced(exact, decoder.grammar, s.prompt_ids, s.action_ids, 0.7)
        assert s.behaviour_logprobs == pytest.approx(behaviour, abs=1e-4)
        assert s.policy_logprobs == pytest.approx(policy_lp, abs=1e-4)
    assert decoder._merged.dtype == torch.float32 and bf16.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_frozen_base_is_the_policy_with_its_adapter_disabled_without_disabling_it(tiny_dir, dtype):
    """frozen_base (the trainer's reference policy of a LoRA run): the log-probabilities TRL's fused head gives with
    the adapter disabled, bit for bit, from the base's own tensors (no copy), while the policy itself keeps
    computing with its adapter."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    base, _ = load_policy(tiny_dir, dtype=dtype)
    add_fused_lm_head(base, temperature=1.0, outputs=("log_probs", "entropy"))   # as TRL patches the policy
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM",
                                            init_lora_weights=False))
    ref = frozen_base(model)
    add_fused_lm_head(ref, temperature=1.0)
    ids = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0   # a left-padded row
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
             "fused_lm_head": True}
    with torch.no_grad():
        with model.disable_adapter():
            disabled = model(**batch).log_probs
        own, live = ref(**batch).log_probs, model(**batch).log_probs
    assert torch.equal(own, disabled) and not torch.allclose(live, disabled)
    shared = {p.data_ptr() for p in model.get_base_model().parameters()}
    assert {p.data_ptr() for p in ref.parameters()} <= shared and not any(p.requires_grad for p in ref.parameters())


def test_no_prefix_reuse_for_sliding_window_layers(policy):
    # a sliding-window cache keeps only the window: nothing to reuse, generation unaffected
    tokenizer = policy[1]
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                         sliding_window=8, max_window_layers=0, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    backend = TransformersBackend(Qwen3ForCausalLM(config).eval(), tokenizer, tools=COMPACT_TOOLS,
                                  max_value_chars=MAX_VALUE_CHARS)
    prompts = [backend.prompt_ids(c) for c in (conversation(), conversation("x"), conversation("a longer issue " * 4))]
    samples = backend.generate(prompts, temperature=0.7, seed=0, max_new_tokens=BUDGET)
    assert not any(s.truncated for s in samples) and len(backend.prefix_cache) == 0
    assert len({len(s.action_ids) for s in samples}) > 1
    # transformers' own cache here: finished rows still leave the batch, and the rest sample as they would alone
    assert [s.action_ids for s in samples] == reference_sample(backend.model, backend.grammar, prompts, 0.7, 0, BUDGET)
    # a proposal call scores its excluded call in a prefill of its own here (its first pass cannot feed it)
    proposals = backend.generate(prompts, temperature=0.7, seed=1, max_new_tokens=BUDGET,
                                 exclude=[s.text for s in samples], exclude_ids=[s.action_ids for s in samples])
    for s, realised in zip(proposals, samples):
        assert s.excluded_logprob == pytest.approx(sum(realised.behaviour_logprobs), abs=1e-4)
        assert s.exclusion_failed or s.action_ids != realised.action_ids


def reference_sample(model, grammar, prompts, temperature, seed, max_new_tokens):
    """Independent reference for a batched call: each row alone, re-encoded in full every token (no
    cache, no padding), with the Gumbel noise the batch draws: one (rows x vocabulary) draw per step."""
    generator = torch.Generator().manual_seed(seed)
    noise = [-torch.empty((len(prompts), model.config.vocab_size)).exponential_(generator=generator).log()
             for _ in range(max_new_tokens)]
    actions = []
    for i, prompt in enumerate(prompts):
        matcher, action = grammar.matcher(), []
        while not matcher.is_terminated and len(action) < max_new_tokens:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + action])).logits[0, -1].float()
            masked = logits.masked_fill(~matcher.allowed(), -math.inf)
            token = int((masked / temperature + noise[len(action)][i]).argmax())
            matcher.advance(token)
            action.append(token)
        actions.append(action)
    return actions


def _passes(grammar, action: list[int]) -> int:
    """The decoding passes after the prefill that a row of `action` takes part in under jump-forward: one after
    each token it samples (a free one) that more tokens follow."""
    matcher, free = grammar.matcher(), []
    for token in action:
        free.append(matcher.forced_token is None)
        matcher.advance(token)
    return sum(free) - free[-1]


def test_rows_leave_the_batch_as_they_finish_and_sample_as_if_they_had_stayed(policy, batch):
    """A row whose call is complete leaves the decoding batch (and the columns only it needed leave the
    cache): each decoding pass feeds only the rows still generating, a row's forced tokens ride in the pass
    of the token before them (jump-forward), and every row samples the tokens it samples alone (a forward pass
    a token, no cache), with its own noise. Also with rows cut off at max_new_tokens."""
    model, tokenizer = policy
    backend = TransformersBackend(model, tokenizer, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    prompts = [backend.prompt_ids(c) for c in batch[:4]]
    steps = []

    def count(module, args, kwargs):  # rows fed per forward call: the prefill, then one per decoding pass
        mask = kwargs.get("attention_mask")
        if mask is None:  # the reference's calls
            return
        steps.append(mask.shape[0])
        assert bool(mask[:, 0].any()), "a column no row attends to was kept"

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        max_new_tokens = BUDGET
        for cut in (False, True):
            steps.clear()
            samples = backend.generate(prompts, temperature=1.0, seed=3, max_new_tokens=max_new_tokens)
            actions = [s.action_ids for s in samples]
            assert actions == reference_sample(model, backend.grammar, prompts, 1.0, 3, max_new_tokens)
            # a pass samples each of its rows' next free token, the tokens the grammar forces after it fed with it;
            # at the first call the prefix every prompt opens with is encoded once, before the batch's prefill
            # (whose rows may be fed in passes by length: length_groups)
            passes = [_passes(backend.grammar, a) for a in actions]
            decoding = [sum(n >= k for n in passes) for k in range(1, max(passes) + 1)]
            head, tail = steps[:len(steps) - len(decoding)], steps[len(steps) - len(decoding):]
            assert tail == decoding
            assert head[:not cut] == [1] * (not cut) and sum(head[not cut:]) == len(prompts)
            assert max(passes) < max(map(len, actions)) / 2   # forced tokens ride along
            lengths = sorted(map(len, actions))
            assert lengths[0] < lengths[-1]  # rows did finish at different steps
            max_new_tokens = lengths[len(lengths) // 2]  # then: some rows complete, the others are cut off
    finally:
        hook.remove()
    assert any(s.truncated for s in samples) and not all(s.truncated for s in samples)


def test_a_decode_layer_appends_in_place_grows_and_keeps_rows_and_columns():
    layer = DecodeLayer(room=4)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    keys, values = layer.update(k, -k)
    buffer = layer._k.data_ptr()
    assert torch.equal(keys, k) and torch.equal(values, -k) and layer.get_seq_length() == 3
    keys, _ = layer.update(k[:, :, :1] + 100, k[:, :, :1])
    assert layer._k.data_ptr() == buffer and keys.shape[2] == 4  # written into the room, no copy
    keys, _ = layer.update(k[:, :, :2] + 200, k[:, :, :2])  # out of room: grows
    assert keys.shape[2] == 6 and layer._k.shape[2] >= 6
    assert torch.equal(keys[:, :, :3], k) and torch.equal(keys[:, :, 4:], k[:, :, :2] + 200)
    layer.keep(torch.tensor([1]), start=2)
    assert layer.keys.shape == (1, 1, 4, 2) and torch.equal(layer.keys[0, :, 0], k[1, :, 2])
    assert layer.get_seq_length() == 4 and torch.equal(layer.values[0, :, 1], k[1, :, 0])


def test_prefix_cache_is_bounded_in_bytes():
    def kv(n):  # one layer, 2 heads, 4 dims: 64 bytes a token
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]
    cache = PrefixCache(max_bytes=64 * 10)
    cache.store([1, 2, 3, 4], kv(4))
    cache.store([1, 2, 3, 4, 5, 6], kv(6))  # extends the first: replaces it
    assert len(cache) == 1 and cache.bytes == 64 * 6
    cache.store([7, 8, 9, 10], kv(4))
    assert len(cache) == 2 and cache.bytes == 64 * 10
    cache.store([11, 12], kv(2))  # over the bound: the least recently used entry goes
    assert cache.bytes <= 64 * 10 and cache.lookup([1, 2, 3, 4, 5, 6, 7])[0] == 0
    assert cache.lookup([7, 8, 9, 10, 0])[0] == 4 and cache.lookup([7, 8])[0] == 1
    cache.store(list(range(20)), kv(20))  # larger than the whole bound: not kept
    assert cache.lookup(list(range(21)))[0] == 0 and cache.bytes <= 64 * 10


def _two_tools(policy, **options) -> TransformersBackend:
    """submit_patch and run_tests only: a call space whose mass sits on a few calls, so exclusion bites."""
    tools = [t for t in COMPACT_TOOLS if t["function"]["name"] in ("submit_patch", "run_tests")]
    return TransformersBackend(*policy, tools=tools, max_value_chars=MAX_VALUE_CHARS, **options)


SUBMIT, RUN_ALL = '{"name": "submit_patch", "arguments": {}}', '{"name": "run_tests", "arguments": {}}'


def test_exclude_never_returns_the_realised_call(policy):
    model, _ = policy
    backend = _two_tools(policy)
    passes = []
    sample_rows = backend._sample
    backend._sample = lambda prompts, *a, **kw: passes.append(len(prompts)) or sample_rows(prompts, *a, **kw)
    samples = backend.generate([conversation()] * 8, temperature=0.7, seed=0, max_new_tokens=BUDGET,
                               exclude=[SUBMIT] * 8)
    # one decoded row per prompt whose first try missed a_t's tokenization (a coin), then a pass of the rows
    # whose steered draw was a_t in another tokenization, if any: never a row per try
    assert passes[0] <= 8 and sum(passes) <= 8 * DEFAULT_MAX_EXCLUSION_TRIES and all(
        later <= earlier for earlier, later in itertools.pairwise(passes))
    realised = parse_tool_call(SUBMIT).canonical()
    prompt, excluded_ids = backend.prompt_ids(conversation()), backend.grammar.tokenize(SUBMIT)
    logq = sum(teacher_forced(model, backend.grammar, prompt, excluded_ids, 0.7)[0])
    for s in samples:
        assert s.excluded_logprob == pytest.approx(logq, abs=1e-4)
        if s.exclusion_failed:   # all tries were a_t, in some tokenization
            assert s.tries == DEFAULT_MAX_EXCLUSION_TRIES and s.proposal_logprob == -math.inf
            continue
        assert parse_tool_call(s.text).canonical() != realised and 1 <= s.tries <= DEFAULT_MAX_EXCLUSION_TRIES
        assert s.proposal_logprob == pytest.approx(sum(s.behaviour_logprobs) - math.log1p(-math.exp(logq)), abs=1e-4)
    assert sum(not s.exclusion_failed for s in samples) >= 4
    # scoring the excluded call feeds only the call: the prompt's keys and values come from the prefix cache
    before = backend.prefix_cache.reused_tokens
    assert sum(backend.score(prompt, excluded_ids, 0.7)["behaviour_logprobs"]) == pytest.approx(logq, abs=1e-4)
    assert backend.prefix_cache.reused_tokens - before == len(prompt) - 1
    # excluded as the tokens it was sampled as (a realised step's): q(a) is theirs, and no draw repeats them
    [realised] = backend.generate([conversation()], temperature=0.7, seed=3, max_new_tokens=BUDGET)
    again = backend.generate([conversation()] * 4, temperature=0.7, seed=4, max_new_tokens=BUDGET,
                             exclude=[realised.text] * 4, exclude_ids=[realised.action_ids] * 4)
    for s in again:
        assert s.excluded_logprob == pytest.approx(sum(realised.behaviour_logprobs), abs=1e-4)
        assert s.action_ids != realised.action_ids
    # a catalogue of one call: every try is the excluded call, so the proposal has no support
    submit_only = TransformersBackend(*policy, tools=[t for t in COMPACT_TOOLS
                                                      if t["function"]["name"] == "submit_patch"])
    [s] = submit_only.generate([conversation()], temperature=0.7, seed=0, max_new_tokens=BUDGET, exclude=[SUBMIT])
    assert s.exclusion_failed and s.tries == DEFAULT_MAX_EXCLUSION_TRIES
    assert s.excluded_logprob == pytest.approx(0.0, abs=1e-5)
    assert s.proposal_logprob == -math.inf


def test_exclusion_draws_what_rejection_draws(policy):
    """The transformers backend's exclusion (a coin per try for a_t's own tokenization, a steered draw for the
    rest) against the rejection sampler that defines q_{not a} (and that vLLM uses). At T = 0.3 this model
    puts about half its mass on that tokenization of submit_patch and a quarter on others. Three tries, so
    that skips are common and the rejection sampler's extra rows few."""
    backend, rows, temperature = _two_tools(policy, max_exclusion_tries=3), 48, 0.3
    prompt, canonical = backend.prompt_ids(conversation()), parse_tool_call(SUBMIT).canonical()
    # a steered draw never emits the excluded tokenization (unsteered: about half of these rows)
    avoid = backend._score_calls([prompt], [backend.grammar.tokenize(SUBMIT)], [SUBMIT], temperature)[0]
    drawn = backend._sample([prompt] * rows, temperature, torch.Generator().manual_seed(2), BUDGET,
                            avoid=[avoid] * rows)
    assert all(s.action_ids != avoid.ids for s in drawn)
    assert sum(s.text == SUBMIT for s in drawn) >= 5   # the call in other tokenizations stays possible
    steered = backend.generate([prompt] * rows, temperature=temperature, seed=1, max_new_tokens=BUDGET,
                               exclude=[SUBMIT] * rows)
    rejected = rejection_sample(backend, [prompt] * rows, [avoid.ids] * rows, [canonical] * rows, temperature,
                                torch.Generator().manual_seed(1), BUDGET)
    assert all(parse_tool_call(s.text).canonical() != canonical for s in steered if not s.exclusion_failed)
    # the same skip rate (all three tries a_t: a draw not steered off its tokenization would count it twice,
    # about 0.7 instead of 0.46; decoding every try, 0.15): a chi-square test of homogeneity, df = 1
    skips = [sum(s.exclusion_failed for s in samples) for samples in (steered, rejected)]
    pooled = sum(skips) / (2 * rows)
    chi2 = sum((k - rows * pooled) ** 2 / (rows * pooled * (1 - pooled)) for k in skips) if 0 < pooled < 1 else 0.0
    assert math.erfc(math.sqrt(chi2 / 2)) > 0.01, (skips, chi2)


def test_the_excluded_call_is_scored_by_the_first_pass_and_draws_as_when_scored_apart(policy):
    """A proposal call feeds the excluded call a after the prompt in its first pass: the logits that score q(a)
    are those a draw that follows a reads, so scoring a costs no pass of its own (before: a prefill for the
    scores, then the sampler's), and each row draws what it drew with a scored apart first."""
    model, _ = policy
    backend = TransformersBackend(*policy, tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    prompt = backend.prompt_ids(conversation())
    [realised] = backend.generate([prompt], temperature=0.7, seed=5, max_new_tokens=BUDGET)
    rows, tries, a = 6, backend.max_exclusion_tries, realised.action_ids
    with passes_fed(model) as fused:
        got = backend.generate([prompt] * rows, temperature=0.7, seed=9, max_new_tokens=BUDGET,
                               exclude=[realised.text] * rows, exclude_ids=[a] * rows)
    # a scored apart, the rows' coins, then one draw of each row whose coins do not all come up a
    generator = torch.Generator().manual_seed(9)
    with passes_fed(model) as apart:
        [avoid] = backend._score_calls([prompt], [a], [realised.text], 0.7)
        coins = torch.rand((rows, tries), generator=generator).log()
        todo = [i for i in range(rows) if (coins[i] >= avoid.logq).any()]
        drawn = backend._sample([prompt] * len(todo), 0.7, generator, BUDGET, avoid=[avoid] * len(todo),
                                drafts=[a] * len(todo))
    assert todo and [got[i].action_ids for i in todo] == [s.action_ids for s in drawn]
    assert all(s.excluded_logprob == pytest.approx(avoid.logq, abs=1e-5) for s in got)
    assert fused[0] == (rows, len(a)) and len(fused) < len(apart)   # a fed once, in the first pass


def test_bad_generation_input_is_a_crr_error(backend):
    conv = [conversation()]
    for kwargs, message in [({"temperature": -1.0}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
                            ({"exclude": [None, None]}, "2 entries"), ({"exclude": ["{oops"]}, "not a valid"),
                            ({"exclude_ids": [[1]]}, "without exclude"),
                            ({"exclude": [None], "exclude_ids": [None, None]}, "exclude_ids has 2"),
                            ({"temperature": 0.0, "exclude": ['{"name": "submit_patch", "arguments": {}}']}, "T_cf")]:
        args = {"temperature": 0.7, "seed": 0, "max_new_tokens": 8} | kwargs
        with pytest.raises(CRRError, match=message):
            backend.generate(conv, **args)
    with pytest.raises(CRRError, match="exceeds the model's context"):
        backend.generate(conv, temperature=0.7, seed=0, max_new_tokens=8192)
    assert backend.generate([], temperature=0.7, seed=0, max_new_tokens=8) == []


def test_cli_model_generate(tiny_dir):
    from crr.cli import app

    result = CliRunner().invoke(app, ["model", "generate", "--model", str(tiny_dir), "--prompt", "Fix calc/core.py",
                                      "--n", "2", "--max-value-chars", "4", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "H_t" in result.output and "grammar rejection rate" in result.output and '"name"' in result.output
    result = CliRunner().invoke(app, ["model", "generate", "--model", str(tiny_dir), "--prompt", "x", "--n", "1",
                                      "--temperature", "0", "--max-value-chars", "4", "--json"])
    [record] = json.loads(result.stdout)
    assert {"text", "entropy", "behaviour_logprobs", "rejection_rate"} <= set(record)


def test_a_tokenizer_trained_also_on_nano_modules_gives_held_out_names_fewer_tokens():
    """train_tokenizer(extra=...) (research/tokenizer_probe.py's nano tokenizer): the BPE also sees nano modules of
    the train split, so names of the test split (its disjoint words, the same syllables) take fewer tokens than
    with the default tokenizer; without extra documents it is the default's tokenizer exactly."""
    rng = random.Random("tokenizer")
    nano = train_tokenizer(extra=(nano_template(rng, "train").modules[0].source for _ in range(300)))
    default = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = Vocabulary("test", random.Random(0))
    names = [vocab.word() for _ in range(300)]

    def per_name(tokenizer):
        return sum(len(tokenizer.encode(" " + n, add_special_tokens=False)) for n in names) / len(names)

    assert per_name(nano) < 0.85 * per_name(default)
    assert train_tokenizer().get_vocab() == default.get_vocab()


def test_split_word_spaces_keeps_whole_words_and_starts_names_without_a_space(tiny_dir, tmp_path):
    """crr.policy.model.split_word_spaces: the same vocabulary; a space stays on a letter run only where the
    run with its space is one token; a nano name gets a space token of its own and starts with a letter token;
    every text decodes back to itself; a tokenizer that is not Qwen-style is refused."""
    from crr.policy.model import split_word_spaces, write_split_model

    split_dir = write_split_model(tiny_dir, tmp_path / "split")
    default, split = AutoTokenizer.from_pretrained(tiny_dir), AutoTokenizer.from_pretrained(split_dir)
    assert split.get_vocab() == default.get_vocab()
    pieces = lambda tok, text: [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]
    line = "    return min(pirbe, nimmi) - 8\n"
    assert pieces(default, line)[:2] == pieces(split, line)[:2] == ["   ", " return"]
    assert " min" in pieces(split, line) and pieces(split, line)[pieces(split, line).index(",") + 1] == " "
    vocab = Vocabulary("test", random.Random(1))
    names = [vocab.word() for _ in range(200)]
    spaced = [n for n in names if "\u0120" + n not in default.get_vocab()]
    assert len(spaced) > 150
    for name in spaced:
        first = pieces(split, f"x = {name}")[3]
        assert pieces(split, f"x = {name}")[2] == " " and not first.startswith(" ") and name.startswith(first)
    rng = random.Random("split")
    texts = [nano_template(rng, "test").modules[0].source for _ in range(20)] + [SYSTEM_PROMPT, line]
    for text in texts:
        assert split.decode(split.encode(text, add_special_tokens=False)) == text
    assert write_split_model(tiny_dir, split_dir) == split_dir  # kept, not rebuilt
    resplit = json.loads((split_dir / "tokenizer.json").read_text())
    assert split_word_spaces(resplit) == resplit  # a re-split tokenizer stays as it is
    with pytest.raises(CRRError, match="no tokenizer.json"):
        write_split_model(tmp_path / "missing", tmp_path / "out")
    other = json.loads((tiny_dir / "tokenizer.json").read_text())
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+|\S+"
    with pytest.raises(CRRError, match="Qwen-style"):
        split_word_spaces(other)


def test_drafts_change_the_passes_not_the_samples(policy, batch):
    """A row fed a guess of its next tokens (crr.policy.drafts) keeps those its sampler draws anyway and masks
    the others out of its cache: with its own call as the draft source it samples that call again in far fewer
    passes, with another row's call the same call too, and the cache it leaves serves the next turn as a fresh
    prefill would."""
    model, tokenizer = policy
    options = dict(tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS)
    fresh = TransformersBackend(model, tokenizer, prefix_cache_bytes=0, **options)
    prompts = [fresh.prompt_ids(c) for c in batch[:4]]
    reference = fresh.generate(prompts, temperature=1.0, seed=3, max_new_tokens=BUDGET)
    calls = [s.action_ids for s in reference]
    passes = {}
    for name, drafts in (("none", None), ("own", calls), ("other", calls[1:] + calls[:1])):
        backend = TransformersBackend(model, tokenizer, **options)
        with passes_fed(model) as fed:
            samples = backend.generate(prompts, temperature=1.0, seed=3, max_new_tokens=BUDGET, drafts=drafts)
        _assert_same_samples(reference, samples)
        passes[name] = len(fed)
        # the next turn from the cache the call left (its guessed-and-refused columns masked out)
        turn = [p + s.action_ids + tokenizer.encode("\nok\n") for p, s in zip(prompts, samples)]
        _assert_same_samples(fresh.generate(turn, temperature=1.0, seed=4, max_new_tokens=BUDGET),
                             backend.generate(turn, temperature=1.0, seed=4, max_new_tokens=BUDGET, drafts=drafts))
    assert passes["own"] < passes["none"] / 2, passes
    assert passes["other"] <= passes["none"], passes


def test_packed_attention_is_sdpa_on_the_cache_as_it_is(policy):
    """A CPU backend sets its policy's attention to crr.policy.attention's: for a pass of several tokens a row
    after a padded cache it runs the query heads packed onto their key/value heads (no repeat of the cache)
    and gives SDPA's logits."""
    from crr.policy.attention import NAME
    from crr.policy.backend import forward
    from crr.policy.prefix_cache import DecodeCache

    model, _ = policy
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert groups > 1
    rows, cached = 3, 40
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size - 1, (rows, cached + 9), generator=generator)
    attention = torch.ones((rows, cached), dtype=torch.long)
    attention[0, :7] = 0   # a padded row
    shapes, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        shapes.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)

    logits = {}
    try:
        torch.nn.functional.scaled_dot_product_attention = spy
        for implementation in ("sdpa", NAME):
            model.set_attn_implementation(implementation)
            for width in (1, 2, 9):
                with torch.no_grad():
                    positions = (attention.cumsum(-1) - 1).clamp(min=0)
                    _, past = forward(model, DecodeCache(model.config.num_hidden_layers, cached + width),
                                      input_ids=ids[:, :cached], attention_mask=attention, position_ids=positions,
                                      use_cache=True, logits_to_keep=1)
                    mask = torch.cat([attention, torch.ones((rows, width), dtype=torch.long)], -1)
                    shapes.clear()
                    out, _ = forward(model, past, input_ids=ids[:, cached:cached + width], attention_mask=mask,
                                     position_ids=positions[:, -1:] + 1 + torch.arange(width), use_cache=True,
                                     logits_to_keep=width)
                logits[implementation, width] = out.logits
                if implementation == NAME and width > 1:   # query heads packed: key/value heads x groups x width
                    assert shapes[0] == (rows, model.config.num_key_value_heads, groups * width, model.config.head_dim)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        model.set_attn_implementation(NAME)
    for width in (1, 2, 9):
        torch.testing.assert_close(logits[NAME, width], logits["sdpa", width], atol=1e-5, rtol=0)


def test_rows_of_very_different_lengths_are_prefilled_apart_and_sample_as_one_pass_does(policy, monkeypatch):
    """Prompts whose uncached rests differ much in length are prefilled in passes of similar lengths
    (`length_groups`: fewer padded tokens) and their caches joined; every row samples what one pass gives."""
    import crr.policy.backend as backend_module

    assert backend_module.length_groups([5, 500, 6, 510], pass_tokens=64) == [[0, 2], [1, 3]]
    assert backend_module.length_groups([100, 101, 102], pass_tokens=64) == [[0, 1, 2]]
    assert backend_module.length_groups([3, 9], pass_tokens=0) == [[0], [1]]
    model, tokenizer = policy
    options = dict(tools=COMPACT_TOOLS, max_value_chars=MAX_VALUE_CHARS, prefix_cache_bytes=0)
    backend = TransformersBackend(model, tokenizer, **options)
    prompts = [backend.prompt_ids(conversation(issue)) for issue in
               ("Fix calc/core.py", "The parser drops the last field of a row " * 30, "Fix io/csv.py",
                "The writer drops the last field of a row " * 30)]
    with passes_fed(model) as fed:
        grouped = backend.generate(prompts, temperature=1.0, seed=7, max_new_tokens=BUDGET)
    assert [rows for rows, _ in fed[:2]] == [2, 2]   # the two short prompts, then the two long ones
    monkeypatch.setattr(backend_module, "length_groups", lambda rests: [list(range(len(rests)))])
    _assert_same_samples(TransformersBackend(model, tokenizer, **options).generate(
        prompts, temperature=1.0, seed=7, max_new_tokens=BUDGET), grouped)
