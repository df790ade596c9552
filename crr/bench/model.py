"""Policy benchmarks: generation (tokens per second of grammar-constrained sampling and the grammar rejection
rate, paper: Appendix "Additional Ablations", tool-grammar rejection statistics, on the paper's prompt) and
the SFT step (tokens per second of TRL's fused LM head and of crr's action-token loss on the same batches)."""

from __future__ import annotations

import time

import torch

from crr.agent.prompt import SYSTEM_PROMPT
from crr.policy.backend import TransformersBackend
from crr.policy.model import load_policy

ISSUE = ("Repository: calc\nWorking directory: /repo (the repository root; tool paths are relative to it)\n\n"
         "Issue title: mean() returns the wrong value for empty input\n\nIssue body:\nCalling `mean([])` raises "
         "ZeroDivisionError instead of returning 0.\n")


def generation_bench(model: str, batch: int = 8, max_new_tokens: int = 64, temperature: float = 0.6,
                     repeats: int = 3, seed: int = 0, max_value_chars: int | None = None,
                     threads: int | None = None) -> dict:
    """Sample `repeats` batches of `batch` calls for one issue prompt; report throughput and rejections."""
    if threads is not None:
        torch.set_num_threads(threads)
    backend = TransformersBackend(*load_policy(model), max_value_chars=max_value_chars)
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ISSUE}]
    backend.generate([conversation], temperature=temperature, seed=seed, max_new_tokens=4)  # warm-up
    samples, start = [], time.perf_counter()
    for r in range(repeats):
        backend.clear_cache()  # each repeat encodes the prompt afresh: the figure is one cold batch's
        samples += backend.generate([conversation] * batch, temperature=temperature, seed=seed + r,
                                    max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - start
    tokens = sum(len(s.action_ids) for s in samples)
    return {"model": model, "batch": batch, "repeats": repeats, "temperature": temperature,
            "max_new_tokens": max_new_tokens, "max_value_chars": max_value_chars,
            "threads": torch.get_num_threads(), "prompt_tokens": len(samples[0].prompt_ids),
            "generated_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "grammar_rejection_rate": sum(s.grammar_rejections for s in samples) / tokens,
            "truncated_rate": sum(s.truncated for s in samples) / len(samples),
            "mean_step_entropy": sum(s.entropy for s in samples) / len(samples)}


def sft_step_bench(model: str, batch: int = 8, steps: int = 6, level: int = 1, bf16: bool = True,
                   threads: int | None = None) -> dict:
    """Time optimizer steps (forward, backward, AdamW) on `steps` batches of curriculum rows, once with the
    loss of TRL's fused LM head (what SFTTrainer computes by default) and once with action_nll (what crr's
    trainer computes); then action_nll again on the same rows batched by length (transformers'
    get_length_grouped_indices, what SFTSettings.group_by_length samples). Same model, same rows, one process,
    so the ratios are the figures to read."""
    from transformers.trainer_pt_utils import get_length_grouped_indices
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    from trl.trainer.utils import add_fused_lm_head

    from crr.policy.grammar import ToolCallGrammar
    from crr.sft.curriculum import curriculum_rows
    from crr.sft.trainer import action_nll

    if threads is not None:
        torch.set_num_threads(threads)
    policy, tokenizer = load_policy(model)
    policy.float().train()
    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer adds it
    rows = curriculum_rows(ToolCallGrammar(tokenizer), batch * (steps + 1), seed=0, levels=(level,))
    collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)

    def batches_of(order: list[int]) -> list[dict]:
        return [collate([{"input_ids": rows[j]["input_ids"],
                          "labels": [t if m else -100
                                     for t, m in zip(rows[j]["input_ids"], rows[j]["assistant_masks"])]}
                         for j in order[i:i + batch]]) for i in range(0, len(order), batch)]

    warm_up, timed_rows = list(range(batch)), list(range(batch, len(rows)))  # the first batch warms up, untimed
    by_length = get_length_grouped_indices([len(rows[j]["input_ids"]) for j in timed_rows], batch,
                                           generator=torch.Generator().manual_seed(0))
    orders = {"random": batches_of(timed_rows), "grouped": batches_of([timed_rows[i] for i in by_length])}

    def action_loss(b: dict) -> torch.Tensor:
        nll, tokens, _ = action_nll(policy, b)
        return nll / tokens

    runs = {"trl_fused_head": (lambda b: policy(**b, fused_lm_head=True).loss, "random"),
            "action_tokens": (action_loss, "random"), "grouped": (action_loss, "grouped")}
    tokens = sum(b["attention_mask"].sum().item() for b in orders["random"])
    result = {"model": model, "batch": batch, "steps": steps, "level": level, "bf16": bf16,
              "threads": torch.get_num_threads(), "tokens": tokens,
              "action_tokens": sum((b["labels"] != -100).sum().item() for b in orders["random"]),
              **{f"{order}_padded_per_token": sum(b["input_ids"].numel() for b in bs) / tokens
                 for order, bs in orders.items()}}
    for name, (loss_fn, order) in runs.items():
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
        for i, b in enumerate(batches_of(warm_up) + orders[order]):
            if i == 1:
                start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(b)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        result[f"{name}_tokens_per_s"] = tokens / (time.perf_counter() - start)
    result["speedup"] = result["action_tokens_tokens_per_s"] / result["trl_fused_head_tokens_per_s"]
    result["grouped_speedup"] = result["grouped_tokens_per_s"] / result["action_tokens_tokens_per_s"]
    return result
