"""The fork benchmark on the local engine (small repositories; timing targets live in the benchmark)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crr.bench.fork import fork_bench, synthetic_task
from crr.cli import app
from crr.errors import CRRError

KEYS = {"engine", "mode", "n_files", "repeats", "snapshot_ms_p50", "snapshot_ms_p95", "restore_ms_p50",
        "restore_ms_p95", "fork_ms_p50", "fork_ms_p95", "exact"}


def _leftovers() -> list[str]:
    cache = Path(os.environ["CRR_CACHE_DIR"])
    checkouts = [p.name for p in (cache / "checkouts").glob("fork-bench-*")]
    return checkouts + [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("crr-fork-bench-")]


def test_synthetic_task_shape(tmp_path):
    task = synthetic_task(tmp_path / "repo", 120)
    files = [p for p in (tmp_path / "repo").rglob("*.py")]
    assert len(files) == 120 and len({p.parent for p in files}) == 6
    assert all(1024 <= p.stat().st_size <= 8192 for p in files)
    assert len(task.base_commit) == 40 and task.repo_src == str(tmp_path / "repo")


def test_local_bench_reports_exact_forks():
    before = _leftovers()
    r = fork_bench("local", n_files=200, repeats=3)
    assert KEYS <= r.keys()
    assert r["engine"] == "local" and r["n_files"] == 200 and r["repeats"] == 3 and r["exact"] is True
    for k in ("snapshot", "restore", "fork"):
        assert 0 < r[f"{k}_ms_p50"] <= r[f"{k}_ms_p95"]
    assert r["fork_ms_p50"] >= r["snapshot_ms_p50"]
    assert _leftovers() == before


def test_local_both_compares_modes():
    r = fork_bench("local", mode="both", n_files=60, repeats=2)
    assert set(r["modes"]) == {"overlay", "copy"} and all(KEYS <= m.keys() for m in r["modes"].values())
    assert r["modes"]["copy"]["mode"] == "copy" and all(m["exact"] for m in r["modes"].values())
    assert r["copy_over_overlay_fork_ratio"] == pytest.approx(
        r["modes"]["copy"]["fork_ms_p50"] / r["modes"]["overlay"]["fork_ms_p50"])


def test_bad_arguments_are_crr_errors():
    with pytest.raises(CRRError, match="modes overlay, copy"):
        fork_bench("local", mode="commit")
    with pytest.raises(CRRError, match="unknown fork engine"):
        fork_bench("qemu")


def test_cli_fork_bench():
    runner = CliRunner()
    res = runner.invoke(app, ["fork", "bench", "--engine", "local", "--files", "50", "--repeats", "2",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert KEYS <= json.loads(res.stdout).keys()
    res = runner.invoke(app, ["fork", "bench", "--files", "50", "--repeats", "2"])
    assert res.exit_code == 0 and "fork p50/p95" in res.stdout and "yes" in res.stdout
    res = runner.invoke(app, ["fork", "bench", "--engine", "local", "--mode", "commit"])
    assert res.exit_code == 2 and "modes overlay, copy" in res.output
