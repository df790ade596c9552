"""What a training run keeps so that a person can look at it afterwards (`crr view`, TensorBoard, W&B):

Trajectory records: every on-policy trajectory of every update and every counterfactual branch, one
gzip JSONL part per update under `trajectories/` (`part-{update:06d}.jsonl.gz`, written to a temporary
name and renamed like the tuple parts of crr.train.tuples, so a part is whole or absent; a resume cuts them
back to its checkpoint with the same `drop_parts_from`). Config switch: `keep_trajectories`.

    {"kind": "trajectory", "update", "row", "task_id", "sibling" (which of the task's G; "group" in
     runs before 2026-11-27, read as "sibling"), "reward" (None: an
     infrastructure failure), "infra_error", "end_reason", "resolution", "model_patch", "replaced"
     (Search-Select trained on a branch's sequence instead), "reset" (the first step the row sampled: 0, or for
     a restart row of method resets the state its prefix, a failed sibling's, was reset to; absent in runs
     before 2026-11-29), "steps": [{"t", "call" | "action", "observation"
     (capped as in the prompt: crr.agent.tools.truncate), "is_error", "entropy" (H_t), "selected",
     "advantage" (the run's estimator), "grpo_advantage"}]}
    {"kind": "branch", "update", "row" (the trajectory it forked), "task_id", "sibling", "t" (the step it forked
     at), "k_index", "selector_score", "proposal" (the counterfactual action; None: the proposal skipped it),
     "proposal_logprob", "steps" (the branch's actions from t on, the proposal first), "reward" (its return;
     None: the fork or its sandbox failed), "end_reason", "infra_error", "played_by" (the row of a sibling that
     took the proposal in the same state: its steps and return are the branch's, nothing was forked; None:
     played, crr.train.counterfactual.played_by; absent in runs before 2026-11-29)}

Scalars for trackers: `tracker_scalars` flattens an iteration's record (metrics.jsonl) into the "crr/..."
numbers the trainer hands to TRL's log, so every `report_to` integration (TensorBoard, W&B) gets them.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from crr.agent.tools import truncate
from crr.errors import CRRError
from crr.train.tuples import drop_parts_from

if TYPE_CHECKING:   # `crr view` reads records without torch and transformers (which these modules import)
    from crr.agent.episode import Step, Trajectory
    from crr.train.advantages import RowCredit
    from crr.train.counterfactual import Branch

RECORDS_DIR = "trajectories"


def part_path(run_path: Path | str, update: int) -> Path:
    return Path(run_path) / RECORDS_DIR / f"part-{update:06d}.jsonl.gz"


def _step(s: Step) -> dict:
    out = {"t": s.t, "observation": truncate(s.observation), "is_error": s.is_error, "entropy": s.entropy}
    return {**out, "call": s.call} if s.call is not None else {**out, "action": s.action}


def collect(trajs: list[Trajectory], branches: list[Branch], rows: dict, picks: dict, resets: list[int]) -> dict:
    """This process's records of one update, before the advantages are known: `trajs` by row (`rows`: the
    rollout's TRL rows, whose completion ids tell a Search-Select replacement from the realised sequence;
    `resets`: each row's reset step)."""
    out = []
    for i, traj in enumerate(trajs):
        selected = {s.t for s in picks.get(i, [])}
        out.append({"kind": "trajectory", "local": i, "task_id": traj.task_id, "sibling": traj.sibling,
                    "reset": resets[i],
                    "reward": traj.reward, "infra_error": traj.infra_error, "end_reason": traj.end_reason,
                    "resolution": traj.resolution, "model_patch": traj.model_patch,
                    "replaced": rows["completion_ids"][i] != traj.completion_ids,
                    "steps": [{**_step(s), "selected": s.t in selected} for s in traj.steps]})
    for b in branches:
        traj = trajs[b.row]
        steps = [_step(s) for s in b.traj.steps[b.t:]] if b.traj is not None else []
        out.append({"kind": "branch", "local": b.row, "task_id": traj.task_id, "sibling": traj.sibling, "t": b.t,
                    "k_index": b.k_index, "selector_score": b.selection.score,
                    "proposal": None if b.sample is None else b.sample.text,
                    "proposal_logprob": None if b.sample is None else b.sample.proposal_logprob,
                    "steps": steps, "reward": b.reward, "end_reason": None if b.traj is None else b.traj.end_reason,
                    "infra_error": b.error if b.traj is None else b.traj.infra_error, "played_by": b.played_by})
    return {"rows": len(trajs), "records": out}


def write_update(run_path: Path | str, update: int, parts: list[dict], rows: list[RowCredit],
                 advantages: list[list[float] | None]) -> Path:
    """Join every process's `collect` (in process order: the batch's row order) with the batch's step
    advantages and GRPO's, and write the update's part atomically."""
    from crr.train.advantages import estimate  # deferred: torch (see the TYPE_CHECKING imports)

    grpo = estimate("grpo", rows)
    records, offset = [], 0
    for part in parts:
        for r in part["records"]:
            row = offset + r.pop("local")
            r = {"update": update, "row": row, **r}
            if r.get("played_by") is not None:   # a row of this process, like "local"
                r["played_by"] += offset
            if r["kind"] == "trajectory":
                adv, base = advantages[row], grpo[row]
                for s in r["steps"]:   # a replaced row's (constant, GRPO-like) advantage is its branch's
                    s["advantage"] = None if adv is None else adv[min(s["t"], len(adv) - 1)]
                    s["grpo_advantage"] = None if base is None else base[min(s["t"], len(base) - 1)]
            records.append(r)
        offset += part["rows"]
    path = part_path(run_path, update)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    os.replace(tmp, path)
    return path


def read_records(run_path: Path | str) -> list[dict]:
    """Every record of a run, update by update (none when it kept no trajectories); a record written before the
    sibling index was named "sibling" has its "group" read as "sibling"."""
    folder = Path(run_path) / RECORDS_DIR
    out = []
    for p in sorted(folder.glob("part-*.jsonl.gz")) if folder.is_dir() else []:
        try:   # parts are written whole (a temporary file, then renamed): a bad one was damaged afterwards
            with gzip.open(p, "rt", encoding="utf-8") as f:
                out.extend(json.loads(line) for line in f if line.strip())
        except (OSError, EOFError, ValueError) as e:   # gzip.BadGzipFile is an OSError; JSON errors ValueErrors
            raise CRRError(f"{p} is corrupt ({' '.join(str(e).split())[:120] or type(e).__name__}): "
                           "the run's records were damaged after they were written") from None
    for r in out:
        if "group" in r:
            r["sibling"] = r.pop("group")
    return out


def drop_records_from(run_path: Path | str, update: int) -> int:
    """Remove the parts of updates >= `update` (a resume redoes them)."""
    return drop_parts_from(Path(run_path), update, RECORDS_DIR)


def outcome_pairs(pairs: list[tuple[float | None, float | None]]) -> dict[str, int]:
    """Counts of (R(tau), R(tilde tau)) outcome pairs of the scored contrasts: "1-0" (the realised step
    did better than its counterfactual), "0-1", "1-1", "0-0"."""
    counts = Counter(f"{r:g}-{cf:g}" for r, cf in pairs if r is not None and cf is not None)
    return {k: counts.get(k, 0) for k in ("1-0", "0-1", "1-1", "0-0")}


def tracker_scalars(record: dict) -> dict[str, float]:
    """An iteration record as flat "crr/..." scalars (nested dicts joined with "/"; None and text left out)."""
    out = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)

    for key, value in record.items():
        if key not in ("event", "step", "time", "group_rewards"):
            walk(f"crr/{key}", value)
    return out
