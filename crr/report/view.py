"""`crr view RUN_DIR...`: one self-contained HTML file to look at runs in a browser (no server, no network:
the data is a JSON block in the page, the script and styles are inlined; docs/view.md).

    path = write_view([Path("results/runs/...-train-crr-seed11")])      # RUN_DIR/view.html
    path = write_view([Path("results/reference/cpu-main/evals")], Path("evals.html"))

A training run (config.yaml, metrics.jsonl, trajectories/ when it kept them: crr.train.records) shows its
learning curves, each update's groups (G siblings per task), each trajectory as a timeline of steps coloured
by the advantage the update gave them (tool call, observation, an edit's diff), the counterfactual branches
forked off their step (their actions and return), and a filter for the steps where the run's advantage
differs from GRPO's. Evaluations (`crr eval` runs: results.jsonl, transcripts.jsonl, summary.json) show the
task-by-task table of the runs (a filter for the tasks some run solves and another does not), each transcript,
the patch and the error mode of crr.eval.taxonomy. A `crr rollout` run (trajectories.jsonl) is shown as an
evaluation whose samples are each task's G siblings. A folder that is not a run is searched for runs inside.
"""

from __future__ import annotations

import json
import math
import re
from importlib.resources import files
from pathlib import Path

from crr.agent.tools import truncate
from crr.errors import CRRError
from crr.eval.stats import wilson
from crr.rundir import atomic_write_text, read_jsonl, read_run_mapping
from crr.train.records import read_records

_TIMESTAMP = re.compile(r"\d{8}-\d{6}-")
_CURVES = ("reward_mean", "adv_std", "contrasts", "cf_share", "fork_share")   # of the iteration records


def _command(path: Path) -> str | None:
    """The crr command that made the run directory `path` (its manifest), None without a manifest."""
    return read_run_mapping(path / "manifest.json").get("command") if (path / "manifest.json").is_file() else None


def is_eval_run(path: Path) -> bool:
    command = _command(path)
    if command is not None:
        return command == "eval"
    return (path / "results.jsonl").is_file() and (path / "transcripts.jsonl").is_file()


def is_rollout_run(path: Path) -> bool:
    return _command(path) == "rollout"


def is_train_run(path: Path) -> bool:
    command = _command(path)
    if command is not None:
        return command == "train"
    return (path / "metrics.jsonl").is_file() and (path / "config.yaml").is_file() and not is_eval_run(path)


def find_runs(paths: list[Path]) -> list[Path]:
    """The run directories named, or found (sorted) inside a folder that is not one."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise CRRError(f"{p}: {'not a' if p.exists() else 'no such'} directory; pass a run directory or a "
                           "folder of them")
        if _shown(p):
            out.append(p)
            continue
        if _command(p) is not None:
            raise CRRError(f"{p} is a `crr {_command(p)}` run; crr view shows `crr train`, `crr eval` and "
                           "`crr rollout` runs")
        found = sorted({q.parent for q in p.rglob("config.yaml") if _shown(q.parent)}
                       | {q.parent for q in p.rglob("results.jsonl") if is_eval_run(q.parent)})
        # a training run's own evaluations (eval-before/, eval-after/) are part of it, not runs of their own
        out.extend(q for q in found if not any(o in q.parents for o in found))
    if not out:
        raise CRRError(f"no training, evaluation or rollout run in {', '.join(map(str, paths))}")
    return out


def _shown(path: Path) -> bool:
    return is_eval_run(path) or is_train_run(path) or is_rollout_run(path)


def label(path: Path, dataset: str | None = None) -> str:
    """A run's name without creation timestamps; an evaluation's without "eval-<dataset>-train-" (what the
    evaluated training run is called: "crr-seed11-checkpoint-17")."""
    name = _TIMESTAMP.sub("", path.name)
    return name.removeprefix(f"eval-{dataset}-").removeprefix("train-") if dataset else name


def load_train(path: Path) -> dict:
    config = read_run_mapping(path / "config.yaml", "YAML")
    metrics = list(read_jsonl(path / "metrics.jsonl"))
    iterations = {r["step"]: r for r in metrics if r.get("event") == "iteration"}   # a resume's redo wins
    trl = {r["step"]: r for r in metrics if r.get("event") == "trl" and "loss" in r}
    curves = {k: [[s, iterations[s].get(k)] for s in sorted(iterations)] for k in _CURVES}
    curves["loss"] = [[s, trl[s]["loss"]] for s in sorted(trl)]
    curves["wall_s"] = [[s, iterations[s]["ledger"]["wall_s"]] for s in sorted(iterations)]
    updates: dict[int, dict] = {}
    for r in read_records(path):
        u = updates.setdefault(r["update"], {"update": r["update"], "trajectories": [], "branches": []})
        u["trajectories" if r["kind"] == "trajectory" else "branches"].append(r)
    return {"kind": "train", "label": label(path), "path": str(path),
            "settings": {k: config.get(k) for k in ("method", "seed", "tasks", "num_generations", "k", "max_turns")},
            "curves": curves, "updates": [updates[u] for u in sorted(updates)]}


def load_eval(path: Path) -> dict:
    summary = read_run_mapping(path / "summary.json") if (path / "summary.json").is_file() else {}
    transcripts = {(t["instance_id"], t.get("sample", 0)): t["steps"] for t in read_jsonl(path / "transcripts.jsonl")}
    results = [_result(r, transcripts.get((r["instance_id"], r.get("sample", 0)), []))
               for r in read_jsonl(path / "results.jsonl")]
    samples = 1 + max((r.get("sample") or 0 for r in results), default=0)   # a sampled evaluation's label says so
    name = label(path, summary.get("dataset")) + (f" x{samples}" if samples > 1 else "")
    return _evaluation(path, name, summary.get("dataset"), summary.get("model"), results)


def load_rollout(path: Path) -> dict:
    """A `crr rollout` run as an evaluation: each task's G siblings are its samples (with no error mode, which
    needs the task's gold patch: `crr eval` gives them)."""
    config = read_run_mapping(path / "config.yaml", "YAML")
    results = [_result({**t, "instance_id": t["task_id"], "sample": t["sibling"], "turns": len(t["steps"])},
                       t["steps"]) for t in read_jsonl(path / "trajectories.jsonl")]
    return _evaluation(path, label(path), config.get("tasks"), config.get("model"), results)


def _result(record: dict, steps: list[dict]) -> dict:
    """One sample of an evaluation's table: its outcome and its transcript."""
    return ({k: record.get(k) for k in ("instance_id", "sample", "reward", "error_mode", "resolution", "end_reason",
                                        "infra_error", "model_patch", "turns")}
            | {"steps": [{"t": s.get("t"), "action": s.get("action"), "is_error": s.get("is_error"),
                          "observation": truncate(s.get("observation", ""))} for s in steps]})


def _evaluation(path: Path, name: str, dataset: str | None, model: str | None, results: list[dict]) -> dict:
    scored = [r["reward"] for r in results if r["reward"] is not None]
    return {"kind": "eval", "label": name, "path": str(path), "dataset": dataset, "model": model,
            "passes": int(sum(scored)), "scored": len(scored),
            "interval": wilson(sum(scored) / len(scored), len(scored)) if scored else None, "results": results}


def render(runs: list[dict]) -> str:
    data = json.dumps({"runs": runs}, separators=(",", ":"), allow_nan=False, default=str)
    data = data.replace("</", "<\\/")   # the JSON sits in a <script> element
    assets = files("crr.report") / "view_assets"
    return ((assets / "view.html").read_text(encoding="utf-8")
            .replace("/*CSS*/", (assets / "view.css").read_text(encoding="utf-8"))
            .replace("/*JS*/", (assets / "view.js").read_text(encoding="utf-8"))
            .replace("{{DATA}}", data))


def _clean(obj):
    """JSON has no NaN: a missing interval or curve value becomes null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_view(paths: list[Path], out: Path | None = None) -> Path:
    """Write the page for the runs in `paths` to `out` (default: view.html in the one run named, else
    crr-view.html here) and return its path."""
    runs = find_runs(paths)
    data = [_clean(load_train(p) if is_train_run(p) else load_rollout(p) if is_rollout_run(p) else load_eval(p))
            for p in runs]
    out = Path(out) if out is not None else (runs[0] / "view.html" if len(paths) == 1 and runs == [Path(paths[0])]
                                             else Path("crr-view.html"))
    if out.is_dir():
        raise CRRError(f"--out {out} is a directory; name the HTML file to write")
    atomic_write_text(out, render(data))   # an interrupted write leaves an earlier page whole
    return out
