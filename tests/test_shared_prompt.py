"""The learner's pass with each distinct prompt encoded once (crr.train.shared_prompt) against TRL's own."""

from __future__ import annotations

import pytest
import torch
from forward_passes import passes_fed
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM
from trl.trainer.utils import add_fused_lm_head

from crr.train.shared_prompt import shared_prompt_logps

PAD, PROMPT, COMPLETION = 0, 40, 24


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=PAD)
    base = Qwen3ForCausalLM(config).float()
    add_fused_lm_head(base, outputs=("log_probs", "entropy"))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def batch(prompts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as TRL lays them out: prompts left-padded, completions of different lengths right-padded.
    `prompts[i]`: which of a few prompts (of different lengths) row i has."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(1, 97, (PROMPT - 7 * p,), generator=g) for p in range(max(prompts) + 1)]
    ids = torch.full((len(prompts), PROMPT + COMPLETION), PAD)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, PROMPT - len(heads[p]):PROMPT], mask[i, PROMPT - len(heads[p]):PROMPT] = heads[p], 1
        n = COMPLETION - 5 * (i % 3)
        ids[i, PROMPT:PROMPT + n], mask[i, PROMPT:PROMPT + n] = torch.randint(1, 97, (n,), generator=g), 1
    return ids, mask


def trl_pass(model, ids, mask):
    """TRL's _get_per_token_logps_and_entropies for these rows (one chunk, no images): the whole sequence."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-COMPLETION] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -COMPLETION:], out.entropy[:, -COMPLETION:]


def with_grads(model, ids, mask, fn):
    model.zero_grad()
    logps, entropies = fn()
    (logps * mask[:, -COMPLETION:]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), entropies.detach(), grads


def test_each_distinct_prompt_is_encoded_once_and_the_loss_and_its_gradients_are_trls(model):
    ids, mask = batch([0, 0, 0, 1, 1, 2])   # two groups of siblings and a lone row, prompts padded differently
    with passes_fed(model) as fed:
        shared = with_grads(model, ids, mask, lambda: shared_prompt_logps(model, ids, mask, COMPLETION, 4, True))
    # chunks of 4 rows: prompts {0, 1} then {1, 2}, each but its last token once; completions after them
    assert fed == [(2, PROMPT - 1), (4, COMPLETION + 1), (2, PROMPT - 1), (2, COMPLETION + 1)]
    reference = with_grads(model, ids, mask, lambda: trl_pass(model, ids, mask))
    scored = mask[:, -COMPLETION:].bool()
    for a, b in zip(shared[:2], reference[:2]):
        assert torch.allclose(a[scored], b[scored], atol=1e-5)
    assert shared[2].keys() == reference[2].keys() and len(shared[2]) > 0
    for name, grad in reference[2].items():
        assert torch.allclose(shared[2][name], grad, atol=1e-5, rtol=1e-4), name


def test_nothing_to_share_is_left_to_trl(model):
    ids, mask = batch([0, 1, 2])
    assert shared_prompt_logps(model, ids, mask, COMPLETION, 3, False) is None
    ids, mask = batch([0, 0, 1, 1])
    assert shared_prompt_logps(model, ids, mask, COMPLETION, 1, False) is None   # chunks of one row


def test_a_pass_with_gradients_through_checkpointed_layers_is_left_to_trl(model):
    """Checkpointed layers drop the cache they are given (they would score the completions without their prompt):
    with gradients such a pass is TRL's; without (the reference pass) nothing is checkpointed and it is shared."""
    ids, mask = batch([0, 0, 1, 1])
    base = model.get_base_model()
    base.gradient_checkpointing_enable()
    try:
        assert base.training
        assert shared_prompt_logps(model, ids, mask, COMPLETION, 4, False) is None
        with torch.no_grad():
            shared = shared_prompt_logps(model, ids, mask, COMPLETION, 4, False)
            reference = trl_pass(model, ids, mask)[0]
        assert shared is not None
        scored = mask[:, -COMPLETION:].bool()
        assert torch.allclose(shared[0][scored], reference[scored], atol=1e-5)
    finally:
        base.gradient_checkpointing_disable()
