"""VLLMBackend against TransformersBackend on real prompts: `python -m crr.bench.vllm [--json OUT]`.

Needs vllm (on CPU: .venv-vllm from scripts/setup-vllm.sh); tests/test_vllm_backend.py runs it there.

Prompts: s_0 of the first `--tasks` tasks of `--task-set` (the model's own agent format), plus every
later prompt of greedy episodes on the first `--episodes` of them (transformers backend, local fork
engine), so multi-turn contexts with real observations are in the set. Measured:
  greedy     per prompt, whether both backends emit the same action tokens, and whether the whole
             StepSample record (entropies, policy log-probabilities, semantic flags, rejections) agrees;
  episodes   whether greedy episodes on the vLLM backend take the same actions and end the same way;
  logprobs   vLLM's own log-probabilities of its tokens (processed_logprobs: log softmax(masked / T))
             against the transformers model's for the same tokens (`score`): at T = 1 on the greedy
             tokens and at each `--temperatures` on sampled calls; `non_emittable` counts sampled tokens
             the transformers sampler could not have emitted (its mask disallows them; should be 0);
  exclusion  the CRR proposal (exclude = the greedy call) gives another call with a finite log-probability.

`--server URL` checks VLLMServerBackend (TRL's server mode) against a running server instead
(`check_server`: the same greedy and log-probability measures, whether every call holds crr's grammar, seeded
reproducibility, the prefix-cache reset and the CPU refusal of weight pushes); episodes are not rerun on the
server, and the exclusion path, which is the in-process backend's, is not repeated.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def _max_abs(pairs) -> float:
    diffs = [abs(a - b) for a, b in pairs]
    return max(diffs) if diffs else 0.0


def _vllm_vs_transformers(vl, hf, prompts, max_new_tokens: int) -> tuple[float, float]:
    """vLLM's processed log-probabilities of its greedy tokens (greedy's processed distribution is
    log softmax(masked logits), T = 1) against the transformers model's: max and mean |difference|."""
    outs = vl.llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [vl.sampling_params(0.0, 0, max_new_tokens) for _ in prompts], use_tqdm=False)
    pairs = []
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        ref = hf.score(p, list(c.token_ids), 1.0)["behaviour_logprobs"]
        pairs += [(lp[t].logprob, r) for lp, t, r in zip(c.logprobs, c.token_ids, ref)]
    return _max_abs(pairs), sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)


def _episode_prompts(trajectories) -> list[list[int]]:
    prompts = []
    for traj in trajectories:
        stream = list(traj.prompt_ids)
        for step in traj.steps:
            prompts.append(list(stream))
            stream += step.action_ids + step.observation_ids
    return prompts


def _rollout(tasks, backend, tokenizer, fmt_name: str, max_turns: int, max_new_tokens: int, context: int | None):
    from crr.agent.episode import EpisodeConfig
    from crr.sandbox import get_engine
    from crr.rollout import RolloutConfig, rollout

    episode = EpisodeConfig(max_turns=max_turns, temperature=0.0, max_new_tokens=max_new_tokens, snapshots=False,
                            agent_format=fmt_name, max_context_tokens=context)
    with get_engine("local") as engine:
        return rollout(tasks, backend, engine, tokenizer,
                       RolloutConfig(group_size=1, seed=0, workers=2, episode=episode))



def _reference(task_set: str, n_tasks: int, model_path: str, dtype: str, max_value_chars: int | None):
    """The tasks, the model's agent format and H, and the transformers backend both checks compare with."""
    import torch

    from crr.agent.prompt import agent_format
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import agent_record, load_policy
    from crr.tasks.loaders import load_tasks

    record = agent_record(model_path)
    model, tokenizer = load_policy(model_path, dtype=getattr(torch, dtype))
    hf = TransformersBackend(model, tokenizer, max_value_chars=max_value_chars, prefix_cache_bytes=0)
    return (load_tasks(task_set)[:n_tasks], agent_format(record.get("agent_format", "paper")),
            record.get("max_turns", 50), model, tokenizer, hf)


def check(model_path: str, task_set: str = "nano-band", n_tasks: int = 6, episodes: int = 2, dtype: str = "float32",
          temperatures: tuple[float, ...] = (1.0,), seeds: int = 4, max_new_tokens: int = 96,
          max_value_chars: int | None = 40, llm_kwargs: dict | None = None) -> dict:
    import torch

    from crr.agent.conversation import Conversation, initial_messages
    from crr.policy.backend import VLLMBackend

    tasks, fmt, max_turns, model, tokenizer, hf = _reference(task_set, n_tasks, model_path, dtype, max_value_chars)
    t0 = time.perf_counter()
    vl = VLLMBackend(model, tokenizer, model_path=model_path, max_value_chars=max_value_chars, **(llm_kwargs or {}))
    init_s = time.perf_counter() - t0
    context = getattr(model.config, "max_position_embeddings", None)
    report: dict = {"model": model_path, "dtype": dtype, "vllm_init_s": round(init_s, 1)}

    # Episodes: the same greedy actions on both backends, end to end.
    hf_run = _rollout(tasks[:episodes], hf, tokenizer, fmt.name, max_turns, max_new_tokens, context)
    vl_run = _rollout(tasks[:episodes], vl, tokenizer, fmt.name, max_turns, max_new_tokens, context)
    report["episodes"] = [{"instance_id": task.instance_id, "turns": [len(a.steps), len(b.steps)],
                           "same_actions": [s.action_ids for s in a.steps] == [s.action_ids for s in b.steps],
                           "end_reason": [a.end_reason, b.end_reason], "reward": [a.reward, b.reward]}
                          for task, a, b in zip(tasks, hf_run.trajectories, vl_run.trajectories)]

    prompts = [Conversation(tokenizer, initial_messages(t, "/testbed", max_turns, fmt.name),
                            tools=fmt.tools).token_ids()
               for t in tasks] + _episode_prompts(hf_run.trajectories)
    report["prompts"] = len(prompts)
    report["prompt_tokens"] = [min(map(len, prompts)), max(map(len, prompts))]

    # Greedy: token equality and the whole record.
    t0 = time.perf_counter()
    a = hf.generate(prompts, temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    hf_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = vl.generate(prompts, temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    vl_s = time.perf_counter() - t0
    same = [x.action_ids == y.action_ids for x, y in zip(a, b)]
    both = [(x, y) for x, y, s in zip(a, b, same) if s]
    report["greedy"] = {
        "equal": sum(same), "total": len(same), "tokens": sum(len(x.action_ids) for x in a),
        "mismatches": [{"prompt": i, "transformers": x.text, "vllm": y.text}
                       for i, (x, y, s) in enumerate(zip(a, b, same)) if not s],
        "same_semantic": all(x.semantic == y.semantic for x, y in both),
        "same_rejections": all(x.grammar_rejections == y.grammar_rejections for x, y in both),
        "entropy_max_abs_diff": _max_abs((h, g) for x, y in both for h, g in zip(x.entropies, y.entropies)),
        "H_t_max_abs_diff": _max_abs((x.entropy, y.entropy) for x, y in both),
        "policy_logprob_max_abs_diff": _max_abs((p, q) for x, y in both
                                                for p, q in zip(x.policy_logprobs, y.policy_logprobs)),
        "batch_s": {"transformers": round(hf_s, 2), "vllm_with_scoring": round(vl_s, 2)},
    }
    # vLLM's own numbers: its processed log-probabilities of the greedy tokens (T = 1 is greedy's
    # processed distribution, log softmax(masked logits)) against the transformers model's.
    diff, mean = _vllm_vs_transformers(vl, hf, prompts, max_new_tokens)
    report["greedy"]["vllm_logprob_max_abs_diff"] = diff
    report["greedy"]["vllm_logprob_mean_abs_diff"] = mean

    # Sampled: vLLM's behaviour log-probabilities against the transformers model's q for the same tokens.
    report["sampled"] = []
    for temperature in temperatures:
        pairs, non_emittable, calls, parsed, tokens = [], 0, 0, 0, 0
        for seed in range(seeds):
            for s in vl.generate(prompts, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens):
                ref = hf.score(s.prompt_ids, s.action_ids, temperature)["behaviour_logprobs"]
                non_emittable += sum(not math.isfinite(r) for r in ref)
                pairs += [(v, r) for v, r in zip(s.behaviour_logprobs, ref) if math.isfinite(r)]
                calls += 1
                tokens += len(s.action_ids)
                parsed += not s.truncated
        report["sampled"].append({
            "temperature": temperature, "calls": calls, "complete_calls": parsed, "tokens": tokens,
            "non_emittable": non_emittable, "logprob_max_abs_diff": _max_abs(pairs),
            "logprob_mean_abs_diff": sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)})

    # The CRR proposal: exclude the greedy call.
    k = min(4, len(prompts))
    excl = vl.generate(prompts[:k], temperature=1.0, seed=0, max_new_tokens=max_new_tokens,
                       exclude=[x.text if not x.truncated else None for x in a[:k]],
                       exclude_ids=[x.action_ids if not x.truncated else None for x in a[:k]])
    report["exclusion"] = [{"excluded": x.text, "got": y.text, "differs": x.text != y.text,
                            "proposal_logprob": y.proposal_logprob, "tries": y.tries}
                           for x, y in zip(a[:k], excl)]

    # Weight sync: perturb the transformers weights, push them to vLLM, greedy must agree again.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.02)
    vl.sync_weights()
    a2 = hf.generate(prompts[:k], temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    b2 = vl.generate(prompts[:k], temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    report["after_sync_weights"] = {"equal": sum(x.action_ids == y.action_ids for x, y in zip(a2, b2)), "total": k,
                                    "changed_by_perturbation": sum(x.action_ids != y.action_ids
                                                                   for x, y in zip(a[:k], a2)),
                                    "vllm_logprob_max_abs_diff": _vllm_vs_transformers(vl, hf, prompts[:k],
                                                                                       max_new_tokens)[0]}
    return report


def _call_checks(grammar, sample) -> bool:
    """Whether a sampled call holds crr's grammar: every action token allowed by crr's own mask where it was
    emitted, the call complete (the grammar terminated at its end), and its JSON a valid tool call."""
    from crr.agent.tools import ToolCallError, parse_tool_call

    matcher = grammar.matcher()
    for token in sample.action_ids:
        if matcher.is_terminated or not matcher.allowed()[token]:
            return False
        matcher.advance(token)
    try:
        parse_tool_call(sample.text)
    except ToolCallError:
        return False
    return matcher.is_terminated and not sample.truncated


def check_server(base_url: str, model_path: str, task_set: str = "nano-band", n_tasks: int = 4, episodes: int = 0,
                 dtype: str = "float32", temperatures: tuple[float, ...] = (1.0,), seeds: int = 2,
                 max_new_tokens: int = 96, max_value_chars: int | None = 40, connect_timeout: float = 0.0) -> dict:
    """VLLMServerBackend at `base_url` (a server on `model_path` in `dtype`) against the transformers backend;
    `connect_timeout`: how long to wait for the server to answer /health."""
    from concurrent.futures import ThreadPoolExecutor

    from crr.agent.conversation import Conversation, initial_messages
    from crr.errors import CRRError
    from crr.policy.backend import VLLMServerBackend

    last = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(phase: str) -> None:  # the seconds since the last lap, as seconds[phase]
        nonlocal last
        now = time.perf_counter()
        seconds[phase], last = round(now - last, 1), now

    tasks, fmt, max_turns, model, tokenizer, hf = _reference(task_set, n_tasks, model_path, dtype, max_value_chars)
    lap("load")
    prompts = [Conversation(tokenizer, initial_messages(t, "/testbed", max_turns, fmt.name),
                            tools=fmt.tools).token_ids()
               for t in tasks]
    if episodes:
        context = getattr(model.config, "max_position_embeddings", None)
        prompts += _episode_prompts(_rollout(tasks[:episodes], hf, tokenizer, fmt.name, max_turns, max_new_tokens,
                                             context).trajectories)
    lap("episodes")
    report: dict = {"server": base_url, "model": model_path, "dtype": dtype, "prompts": len(prompts),
                    "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))]}

    # Greedy: the same tokens, and the server's log-probabilities of them (T = 1's) against the transformers model's.
    a = hf.generate(prompts, temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    lap("greedy_transformers")
    # (connected only now, so a server still starting has the transformers side's time to come up)
    sv = VLLMServerBackend(model, tokenizer, base_url, max_value_chars=max_value_chars,
                           connection_timeout=connect_timeout)
    lap("connect")
    b = sv.generate(prompts, temperature=0.0, seed=0, max_new_tokens=max_new_tokens)
    lap("greedy_server")
    same = [x.action_ids == y.action_ids for x, y in zip(a, b)]
    with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
        greedy = list(pool.map(lambda p: sv.request(p, 0.0, 0, max_new_tokens), prompts))
    pairs = [pair for p, (ids, logprobs) in zip(prompts, greedy)
             for pair in zip(logprobs, hf.score(p, ids, 1.0)["behaviour_logprobs"])]
    report["greedy"] = {
        "equal": sum(same), "total": len(same), "tokens": sum(len(x.action_ids) for x in a),
        "mismatches": [{"prompt": i, "transformers": x.text, "server": y.text}
                       for i, (x, y, s) in enumerate(zip(a, b, same)) if not s],
        "grammatical": sum(_call_checks(hf.grammar, y) for y in b),
        "server_logprob_max_abs_diff": _max_abs(pairs),
    }
    lap("greedy_logprobs")

    # Sampled: the server's behaviour log-probabilities against the transformers model's q for the same tokens.
    report["sampled"] = []
    for temperature in temperatures:
        pairs, non_emittable, calls, grammatical, tokens, first = [], 0, 0, 0, 0, []
        for seed in range(max(seeds, 1)):
            batch = sv.generate(prompts, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens)
            if seed == 0:
                first = [s.action_ids for s in batch]
            for s in batch:
                ref = hf.score(s.prompt_ids, s.action_ids, temperature)["behaviour_logprobs"]
                non_emittable += sum(not math.isfinite(r) for r in ref)
                pairs += [(v, r) for v, r in zip(s.behaviour_logprobs, ref) if math.isfinite(r)]
                calls += 1
                tokens += len(s.action_ids)
                grammatical += _call_checks(hf.grammar, s)
        again = sv.generate(prompts, temperature=temperature, seed=0, max_new_tokens=max_new_tokens)
        report["sampled"].append({
            "temperature": temperature, "calls": calls, "grammatical": grammatical, "tokens": tokens,
            "non_emittable": non_emittable, "logprob_max_abs_diff": _max_abs(pairs),
            "seed_reproducible": [x.action_ids for x in again] == first,
            "differ_from_greedy": sum(x != y.action_ids for x, y in zip(first, a))})
    lap("sampled")

    # The server's prefix-cache reset and weight push.
    sv.clear_cache()
    try:
        sv.sync_weights()
        report["sync_weights"] = "pushed"
    except CRRError as e:
        report["sync_weights"] = f"CRRError: {e}"
    lap("reset_sync")
    report["seconds"] = seconds
    return report


def main(argv: list[str] | None = None) -> int:
    from crr.policy.model import SHIPPED_DEFAULT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_DEFAULT))
    ap.add_argument("--task-set", default="nano-band")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperatures", default="1.0")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile in vLLM (faster start)")
    ap.add_argument("--json", type=Path, help="write the report here (else to stdout)")
    ap.add_argument("--server", metavar="URL", help="check VLLMServerBackend against the vLLM server at URL "
                    "(started with --model and --dtype as given here; see crr.policy.backend.vllm_server_command)")
    ap.add_argument("--connect-timeout", type=float, default=0.0, metavar="SECONDS",
                    help="with --server: wait up to this long for the server to come up")
    args = ap.parse_args(argv)
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    if args.server:
        report = check_server(args.server, args.model, args.task_set, args.tasks, args.episodes, args.dtype,
                              temperatures, args.seeds, args.max_new_tokens, connect_timeout=args.connect_timeout)
    else:
        report = check(args.model, args.task_set, args.tasks, args.episodes, args.dtype, temperatures, args.seeds,
                       args.max_new_tokens, llm_kwargs={"enforce_eager": True} if args.enforce_eager else None)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
