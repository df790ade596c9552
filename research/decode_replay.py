"""Generation of a training run, replayed: the seconds of its rollout calls, its proposals and its branches'
calls, without the sandboxes, the verifier or the learner around them (their noise is most of a training
benchmark's), so that two decoder settings compare on the same calls.

    capture: .venv/bin/python research/decode_replay.py capture LOG [crr train options and overrides]
    replay:  .venv/bin/python research/decode_replay.py replay LOG MODEL [drafts=0] [draft_tokens=N]

`capture` runs `crr train` and records every `TransformersBackend.generate` call (its prompts' token ids,
seed, exclusions and draft sources) and every cache clear, tagged "roll" (the rollout, live forks included),
or "cf" (run_branches: the proposals, marked "_prop", and the branches' calls). Use `learning_rate=1e-12` and
`dtype=float32`: `replay` decodes from MODEL in float32, which is the run's policy only while its LoRA update
is zero. `replay` plays the calls in order on one backend (so the prefix cache holds what it held) with one
intra-op thread and prints the seconds and sampled tokens per tag; `drafts=0` replays without the episodes'
draft sources (a proposal still drafts from the call it avoids, crr.policy.backend._sample_excluding).
Used for docs/training.md, "Drafts".
"""

from __future__ import annotations

import collections
import pickle
import sys
import time

import torch


def capture(log_path: str, args: list[str]) -> None:
    import crr.policy.backend as backend_module
    import crr.train.counterfactual as counterfactual
    import crr.train.trainer as trainer
    from crr.cli import app

    calls, phase = [], ["roll"]
    generate, clear, run_branches = (backend_module.TransformersBackend.generate,
                                     backend_module.TransformersBackend.clear_cache, counterfactual.run_branches)

    def recorded_generate(self, conversations, temperature, seed, max_new_tokens, exclude=None, exclude_ids=None,
                          drafts=None):
        calls.append(("generate", phase[0], [self.prompt_ids(c) for c in conversations], temperature, seed,
                      max_new_tokens, exclude, exclude_ids, drafts))
        return generate(self, conversations, temperature, seed, max_new_tokens, exclude=exclude,
                        exclude_ids=exclude_ids, drafts=drafts)

    def recorded_clear(self):
        calls.append(("clear",))
        return clear(self)

    def tagged_branches(*a, **k):
        phase[0] = "cf"
        try:
            return run_branches(*a, **k)
        finally:
            phase[0] = "roll"

    backend_module.TransformersBackend.generate = recorded_generate
    backend_module.TransformersBackend.clear_cache = recorded_clear
    trainer.run_branches = tagged_branches
    try:
        app(["train", *args], standalone_mode=False)
    finally:
        with open(log_path, "wb") as f:
            pickle.dump(calls, f)


def replay(log_path: str, model_path: str, options: dict[str, str]) -> None:
    from crr.policy.backend import DEFAULT_DRAFT_TOKENS, TransformersBackend
    from crr.policy.model import load_policy

    torch.set_num_threads(1)
    with open(log_path, "rb") as f:
        calls = pickle.load(f)
    model, tokenizer = load_policy(model_path)
    backend = TransformersBackend(model.float(), tokenizer,
                                  draft_tokens=int(options.get("draft_tokens", DEFAULT_DRAFT_TOKENS)))
    drafting = options.get("drafts", "1") != "0"
    seconds, tokens = collections.Counter(), collections.Counter()
    for call in calls:
        if call[0] == "clear":
            backend.clear_cache()
            continue
        _, phase, prompts, temperature, seed, max_new_tokens, exclude, exclude_ids, drafts = call
        tag = phase + ("_prop" if exclude else "")
        start = time.perf_counter()
        samples = backend.generate(prompts, temperature, seed, max_new_tokens, exclude=exclude,
                                   exclude_ids=exclude_ids, drafts=drafts if drafting else None)
        seconds[tag] += time.perf_counter() - start
        tokens[tag] += sum(len(s.action_ids) for s in samples)
    for tag in seconds:
        print(f"{tag:8s} {seconds[tag]:7.2f} s  {tokens[tag]:6d} tokens")
    print(f"{'all':8s} {sum(seconds.values()):7.2f} s")


if __name__ == "__main__":
    command, log, *rest = sys.argv[1:]
    if command == "capture":
        capture(log, rest)
    else:
        replay(log, rest[0], dict(option.split("=", 1) for option in rest[1:]))
