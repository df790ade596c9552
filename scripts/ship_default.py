"""Install a warm-started model as crr's shipped default (crr/policy/default), or another shipped model
(--target, e.g. crr/policy/multi, the multi tier's warm start), with its provenance beside it.

    .venv/bin/python scripts/ship_default.py MODEL_DIR --recipe experiments/sft-nano.yaml \
        --data-run SFT_RUN_DIR... [--eval EVAL_RUN_DIR ...] [--note "how it was trained"] [--base-provenance FILE] \
        [--target DIR] [--dtype bfloat16|float32]

Writes the weights in bf16 (a few MB; crr loads them in the dtype they were saved in, "auto"), the tokenizer,
the agent record (crr_agent.json) and `provenance.json`: the recipe, its data manifest (the expert summaries
of the crr sft runs that played its episodes: episodes played, kept, steps and tokens) and each evaluation's
measured pass@1 with the command that reproduces it; for a model fine-tuned from an earlier shipped default,
that model's provenance under "base". Paths are stored relative to the repository.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import yaml

from crr.policy.model import AGENT_FILE, SHIPPED_DEFAULT, load_policy
from crr.sandbox.checkout import building
from crr.rundir import RunDir

REPO = Path(__file__).resolve().parent.parent


def _rel(path: Path | str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else p.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--recipe", required=True, help="the recipe YAML the model was trained by")
    ap.add_argument("--data-run", nargs="+", required=True, help="crr sft run directories that made its expert data")
    ap.add_argument("--eval", nargs="*", default=[], help="crr eval run directories of this model")
    ap.add_argument("--note", default="", help="how the weights were trained (device, command)")
    ap.add_argument("--base-provenance", help="provenance.json of the model this one was fine-tuned from")
    ap.add_argument("--target", type=Path, default=SHIPPED_DEFAULT, help="where it goes (default: crr/policy/default)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the weights' dtype (crr loads a model in it): evaluate the model in the dtype it ships in")
    args = ap.parse_args()

    model, tokenizer = load_policy(args.model)
    evals = []
    for path in args.eval:
        run = RunDir.open(path)
        summary = json.loads((run.path / "summary.json").read_text())
        cfg = run.config
        evals.append({"dataset": cfg["dataset"], "n_tasks": cfg.get("n_tasks"), "samples": cfg["samples"],
                      "temperature": cfg["temperature"], "max_turns": cfg["max_turns"],
                      "max_new_tokens": cfg["max_new_tokens"], "pass_at_1": summary["pass_at_1"],
                      "pass_at_k": summary.get("pass_at_k"), "all_n": summary.get("all_n"),
                      "error_modes": {m: v["count"] for m, v in summary.get("error_modes", {}).items()}})
    provenance = {
        "recipe": {"file": _rel(args.recipe), **yaml.safe_load(Path(args.recipe).read_text())},
        "data": [{"run": Path(r).name, "tasks": _rel(RunDir.open(r).config["recipe"]["tasks"]),
                  **json.loads((Path(r) / "expert_summary.json").read_text())} for r in args.data_run],
        "sft_record": json.loads((Path(args.model) / "crr_sft.json").read_text())
        if (Path(args.model) / "crr_sft.json").is_file() else None,
        "training_note": args.note,
        "evaluations": evals,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if args.base_provenance:
        provenance["base"] = json.loads(Path(args.base_provenance).read_text())
    if provenance["sft_record"]:
        provenance["sft_record"]["base_model"] = Path(provenance["sft_record"]["base_model"]).name
    target = args.target.resolve()
    with building(target, keep_theirs=lambda _: False) as tmp:
        model.to(getattr(torch, args.dtype)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.copy(Path(args.model) / AGENT_FILE, tmp / AGENT_FILE)
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)  # the one it replaces
    print(f"installed {_rel(target)} ({sum(f.stat().st_size for f in target.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    sys.exit(main())
