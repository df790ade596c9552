"""The counterfactual trajectory dataset (paper: Appendix "Counterfactual Trajectory Dataset"): one tuple
per counterfactual branch, written as one parquet part per iteration under `tuples/` (written to a
temporary name and renamed, so a part is whole or absent; read back part by part, a damaged one named).

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

from crr.errors import CRRError

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
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(records, schema=SCHEMA), tmp)
        os.replace(tmp, path)
    except OSError as e:   # disk full, read-only (Arrow's errors carry no errno: its message says why)
        tmp.unlink(missing_ok=True)
        raise CRRError(f"cannot write {path}: {' '.join(str(e).split())}") from None
    return path


def read_tuples(run_path: Path | str) -> pd.DataFrame:
    """Every tuple of a run (an empty frame with the schema's columns when there are none)."""
    folder = Path(run_path) / TUPLES_DIR
    parts = sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []
    if not parts:
        return SCHEMA.empty_table().to_pandas()
    tables = []
    for part in parts:   # parts are renamed into place whole: one that is not was damaged afterwards
        try:
            tables.append(ds.dataset(str(part), schema=SCHEMA, format="parquet").to_table())
        except (pa.ArrowException, OSError) as e:
            raise CRRError(f"{part} is corrupt (not a whole parquet file: {' '.join(str(e).split())[:160]}); "
                           "delete it to drop its iteration's tuples") from None
    return pa.concat_tables(tables).to_pandas()


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
