"""The multi expert's episode lengths on a task set: decisions and tokens, mean and p95 (issue 30's figure).

    .venv/bin/python research/multi_expert_stats.py multi-val --n 64

Each task's episode is planned by crr.agent.expert.explore_script (default ExpertConfig, seed 0), played in a
local sandbox and scored by the verifier, as `crr sft` builds its expert data (crr.sft.warm_start.expert_episode),
in the compact format with H = 12; tokens are counted with the shipped default's tokenizer. A catalogue name
loads its first N tasks only (generated once into the crr cache); any other source goes to load_tasks.
"""

import argparse
import json
from collections import Counter

import numpy as np
from transformers import AutoTokenizer

from crr.agent.expert import ExpertConfig
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import default_model_dir
from crr.sandbox import get_engine
from crr.sft.warm_start import ExpertDataSettings, expert_episode
from crr.tasks.loaders import MICRO_RANGES, MICRO_SETS, load_micro, load_tasks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    if args.source in MICRO_SETS:
        tier, split = MICRO_SETS[args.source]
        tasks = load_micro(split, n=args.n, tier=tier, first=MICRO_RANGES.get(args.source, (0, 0))[0])
    else:
        tasks = load_tasks(args.source)[:args.n]
    grammar = ToolCallGrammar(AutoTokenizer.from_pretrained(str(default_model_dir())))
    settings = ExpertDataSettings(max_turns=12, agent_format="compact", expert=ExpertConfig())
    engine = get_engine("local")
    records = []
    try:
        for task in tasks:
            _, rec = expert_episode(task, engine, grammar, 0, settings)
            rec.update(n_bugs=task.metadata["n_bugs"], style=task.metadata["issue_style"])
            records.append(rec)
            print(json.dumps({k: rec[k] for k in ("instance_id", "reward", "steps", "tokens", "action_tokens",
                                                  "wrong_edit", "n_bugs", "style")}), flush=True)
    finally:
        engine.close()
    steps, tokens = np.array([r["steps"] for r in records]), np.array([r["tokens"] for r in records])
    print("SUMMARY", json.dumps({
        "source": args.source, "n": len(records), "solved": sum(r["reward"] == 1.0 for r in records),
        "decisions_mean": round(float(steps.mean()), 2), "decisions_p95": float(np.percentile(steps, 95)),
        "decisions_min": int(steps.min()), "decisions_max": int(steps.max()),
        "tokens_mean": round(float(tokens.mean()), 1), "tokens_p95": round(float(np.percentile(tokens, 95)), 1),
        "action_tokens_mean": round(float(np.mean([r["action_tokens"] for r in records])), 1),
        "n_bugs": dict(sorted(Counter(r["n_bugs"] for r in records).items())),
        "wrong_edits": sum(r["wrong_edit"] is not None for r in records)}))


if __name__ == "__main__":
    main()
