"""What bounds a counterfactual branch's cost on two CPU cores? (issue 29, section 3; docs/training.md, "What
bounds the branches on two cores")

Three measurements with the shipped default, each printed as it ends:

  batch    TransformersBackend.generate() of the edit (step 1) of B recorded nano-band trajectories (the committed
           comparison's CRR runs), float32 as the merged decoder of training runs:
           milliseconds per row, B = 1, 2, 4, 8, 16, and again with each prompt's keys and values in the
           prefix cache (as a branch finds its parent's). The branches of a nano update decode a batch
           of about 3 rows, its rollout a batch of 8.
  beside   an update-like workload (forward and backward of the bf16 policy, 8 rows of 700 tokens, 4 times)
           alone, then with a decode workload (4 rows: 500 prompt tokens, 60 decoded, 3 times) in a thread
           of the same process, as branches_beside_update runs them, and in a spawned process of its own
           (one intra-op thread), which no GIL would hold up.
  compile  one decode pass of 4 rows over a 600-token cache, eager against torch.compile(dynamic=True).

    .venv/bin/python research/branch_phase_probe.py [--parts batch,beside,compile] [--threads 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

import torch

from crr.agent.conversation import Conversation, initial_messages
from crr.agent.prompt import agent_format
from crr.policy.backend import TransformersBackend
from crr.policy.model import agent_record, default_policy_dir, load_policy
from crr.tasks.loaders import load_tasks

RECORDED = Path("results/reference/cpu-main/runs/crr")   # the committed comparison's CRR runs


def edit_prompts(rows: int, tokenizer, fmt, max_turns: int) -> list[list[int]]:
    """The token ids before the edit (step 1) of `rows` recorded CRR trajectories of nano-band that viewed a file
    first: what a branch forked at the edit conditions on."""
    tasks = {t.instance_id: t for t in load_tasks("nano-band")}
    prompts = []
    for part in sorted(RECORDED.glob("*/trajectories/part-*.jsonl.gz")):
        for line in gzip.open(part, "rt"):
            row = json.loads(line)
            steps = row.get("steps") or []
            if row["kind"] != "trajectory" or row["task_id"] not in tasks or len(steps) < 2 \
                    or (steps[0].get("call") or {}).get("name") != "view_file":
                continue
            conv = Conversation(tokenizer, initial_messages(tasks[row["task_id"]], "/testbed", max_turns, fmt.name),
                                fmt.tools)
            call = steps[0]["call"]
            conv.add_action(json.dumps({"name": call["name"], "arguments": call["arguments"]}))
            conv.add_observation(steps[0]["observation"], call["name"])
            prompts.append(conv.token_ids())
            if len(prompts) == rows:
                return prompts
    raise SystemExit(f"fewer than {rows} recorded trajectories under {RECORDED}")


def batch_part(repeats: int = 3) -> None:
    model, tokenizer = load_policy(default_policy_dir(), dtype=torch.float32)
    record = agent_record(default_policy_dir())
    fmt = agent_format(record["agent_format"])
    backend = TransformersBackend(model, tokenizer)   # the grammar of every tool, whatever the format renders
    prompts = edit_prompts(16, tokenizer, fmt, record["max_turns"])
    backend.generate(prompts[:2], temperature=0.6, seed=0, max_new_tokens=96)   # warm-up
    for rows in (1, 2, 4, 8, 16):
        cold, warm, tokens = [], [], 0
        for r in range(repeats):
            backend.clear_cache()
            for walls in (cold, warm):   # the second call finds each prompt's keys and values in the prefix cache
                start = time.perf_counter()
                out = backend.generate(prompts[:rows], temperature=0.6, seed=r, max_new_tokens=96)
                walls.append(time.perf_counter() - start)
            tokens += sum(len(s.action_ids) for s in out)
        cold_s, warm_s = statistics.median(cold), statistics.median(warm)
        print(f"batch  B={rows:2d}: a row {cold_s / rows * 1000:4.0f} ms, {warm_s / rows * 1000:4.0f} ms with its "
              f"prompt cached ({cold_s * 1000:.0f} and {warm_s * 1000:.0f} ms a call; {tokens / repeats / rows:.0f} "
              f"tokens a row after {sum(map(len, prompts[:rows])) / rows:.0f})", flush=True)


def _decode(repeats: int = 3, threads: int | None = None) -> float:
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_policy(default_policy_dir(), dtype=torch.float32)
    start = time.perf_counter()
    with torch.no_grad():
        for r in range(repeats):
            ids = torch.randint(10, 6000, (4, 500), generator=torch.Generator().manual_seed(r))
            out = model(ids, use_cache=True, logits_to_keep=1)
            for _ in range(60):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    return time.perf_counter() - start


def _in_process(queue) -> None:
    queue.put(_decode(threads=1))


def beside_part() -> None:
    model, _ = load_policy(default_policy_dir())   # bf16, as the update trains it

    def update(repeats: int = 4) -> float:
        start = time.perf_counter()
        for r in range(repeats):
            ids = torch.randint(10, 6000, (8, 700), generator=torch.Generator().manual_seed(r))
            model(ids, labels=ids).loss.backward()
        return time.perf_counter() - start

    update(1)
    alone_update, alone_decode = update(), _decode()
    print(f"beside alone: update {alone_update:.2f} s, decode {alone_decode:.2f} s (serial sum "
          f"{alone_update + alone_decode:.2f} s)", flush=True)
    got: dict[str, float] = {}
    thread = threading.Thread(target=lambda: got.setdefault("decode", _decode()))
    thread.start()
    u = update()
    thread.join()
    print(f"beside a thread: update {u:.2f} s, decode {got['decode']:.2f} s", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_in_process, args=(queue,))
    proc.start()
    time.sleep(3.0)   # its imports and model load, before the update starts
    u = update()
    d = queue.get()
    proc.join()
    print(f"beside a process (1 thread): update {u:.2f} s, decode {d:.2f} s", flush=True)


def compile_part(steps: int = 60) -> None:
    model, _ = load_policy(default_policy_dir(), dtype=torch.float32)

    def passes(body) -> float:
        with torch.no_grad():
            out = model(torch.randint(10, 6000, (4, 600)), use_cache=True, logits_to_keep=1)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(3):   # warm-up (and, compiled, the compilation)
                past, token = body(token, past)
            start = time.perf_counter()
            for _ in range(steps):
                past, token = body(token, past)
        return (time.perf_counter() - start) / steps * 1000

    def eager(token, past):
        out = model(token, past_key_values=past, use_cache=True)
        return out.past_key_values, out.logits[:, -1:].argmax(-1)

    compiled_body = torch.compile(model.model, dynamic=True)

    def compiled(token, past):
        h = compiled_body(token, past_key_values=past, use_cache=True)
        return h.past_key_values, model.lm_head(h.last_hidden_state[:, -1:]).argmax(-1)

    e = passes(eager)
    start = time.perf_counter()
    c = passes(compiled)
    print(f"compile: a decode pass {e:.2f} ms eager, {c:.2f} ms compiled (this part took "
          f"{time.perf_counter() - start:.0f} s with the compilation)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="batch,beside,compile")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of this process")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    parts = {"batch": batch_part, "beside": beside_part, "compile": compile_part}
    for name in args.parts.split(","):
        parts[name]()


if __name__ == "__main__":
    main()
