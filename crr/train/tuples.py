"""The counterfactual trajectory dataset (paper: Appendix "Counterfactual Trajectory Dataset"): one tuple
per counterfactual branch, written as one parquet part per iteration under `tuples/` (written to a
temporary name and renamed, so a part is whole or absent; read back as one pyarrow dataset).

A tuple holds the task id, policy seed and version (the update count when the branch was sampled), the
selected index t, the snapshot id of s_t, the realised action a_t and the counterfactual action, the
replayable action suffixes (the realised prefix a_0..a_{t-1}, the realised suffix a_t..a_T and the
counterfactual suffix, as call texts), R(tau), R(tilde tau) (null when the branch's sandbox failed), the
proposal log-probability, the selector score and the K index.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

TUPLES_DIR = "tuples"
SCHEMA = pa.schema([
    ("task_id", pa.string()), ("policy_seed", pa.int64()), ("policy_version", pa.int64()),
    ("iteration", pa.int64()), ("row", pa.int64()), ("t", pa.int64()), ("steps", pa.int64()),
    ("snapshot_id", pa.string()), ("realised_action", pa.string()), ("counterfactual_action", pa.string()),
    ("prefix_actions", pa.list_(pa.string())), ("realised_suffix", pa.list_(pa.string())),
    ("counterfactual_suffix", pa.list_(pa.string())), ("reward", pa.float64()), ("cf_reward", pa.float64()),
    ("cf_end_reason", pa.string()), ("cf_infra_error", pa.string()), ("proposal_logprob", pa.float64()),
    ("selector_score", pa.float64()), ("k_index", pa.int64()), ("prefix_signature", pa.string()),
])


def part_path(run_path: Path, iteration: int) -> Path:
    return Path(run_path) / TUPLES_DIR / f"part-{iteration:06d}.parquet"


def write_part(run_path: Path, iteration: int, records: list[dict]) -> Path | None:
    """Write one iteration's tuples atomically; nothing when there are none."""
    if not records:
        return None
    path = part_path(run_path, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), tmp)
    os.replace(tmp, path)
    return path


def read_tuples(run_path: Path | str) -> pd.DataFrame:
    """Every tuple of a run (an empty frame with the schema's columns when there are none)."""
    folder = Path(run_path) / TUPLES_DIR
    parts = sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []
    if not parts:
        return SCHEMA.empty_table().to_pandas()
    return ds.dataset([str(p) for p in parts], schema=SCHEMA, format="parquet").to_table().to_pandas()


def drop_parts_from(run_path: Path, iteration: int, folder: str = TUPLES_DIR) -> int:
    """Remove the parts of iterations >= `iteration` (not covered by the checkpoint a resume starts from)
    from `folder` (any folder of `part-{iteration:06d}.*` files: the tuples, the trajectory records)."""
    folder = Path(run_path) / folder
    gone = 0
    for p in folder.glob("part-*") if folder.is_dir() else []:
        if p.name.endswith(".tmp") or int(p.name.split("-")[1].split(".")[0]) >= iteration:
            p.unlink()
            gone += 1
    return gone
