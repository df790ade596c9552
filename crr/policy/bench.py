"""Generation benchmark: tokens per second of grammar-constrained sampling and the grammar rejection
rate (paper: Appendix "Additional Ablations", tool-grammar rejection statistics), on the paper's prompt."""

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
