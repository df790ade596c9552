"""crr tasks band: the learnable band read off a real sampled evaluation of the shipped default on nano tasks
(real git repositories, real pytest grading), written as a self-contained task set that loads and trains."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.eval.band import BAND_FILE, select_band
from crr.eval.passk import instance_counts
from crr.rundir import RunDir
from crr.tasks.loaders import load_tasks
from crr.tasks.micro import generate_micro



def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def sampled_eval(tmp_path_factory):
    """4 nano-train tasks, each sampled 4 times at T = 0.6 by the shipped default (H = 4), its bf16 weights in
    float32 (a CPU without AVX512-BF16 emulates bf16: ~3x the seconds)."""
    root = tmp_path_factory.mktemp("band")
    generate_micro(root / "pool", n=4, seed=0, split="train", tier="nano")
    result = cli("eval", "tasks", str(root / "pool"), "--samples", "4", "--temperature", "0.6", "--max-turns", "4",
                 "--max-new-tokens", "96", "--workers", "2", "--dtype", "float32", "--out", str(root / "evals"),
                 "--json")
    assert result.exit_code == 0, result.output
    return root, RunDir.open(json.loads(result.stdout)["run_dir"])


def test_select_band_keeps_rates_inside_the_band_in_task_order(sampled_eval):
    root, _ = sampled_eval
    tasks = load_tasks(root / "pool")
    ids = [t.instance_id for t in tasks]
    counts = {ids[0]: (4, 0), ids[1]: (4, 1), ids[2]: (4, 3), ids[3]: (2, 1)}
    assert [t.instance_id for t in select_band(tasks, counts, 0.25, 0.75)] == ids[1:]
    assert [t.instance_id for t in select_band(tasks, counts, 0.25, 0.75, min_samples=4)] == ids[1:3]
    assert [t.instance_id for t in select_band(tasks, counts, 0.0, 0.0)] == ids[:1]


def test_band_from_a_sampled_eval_is_a_self_contained_task_set(sampled_eval, tmp_path):
    root, run = sampled_eval
    result = cli("tasks", "band", str(run.path), "--low", "0", "--high", "1", "--out", str(tmp_path / "band"))
    assert result.exit_code == 0, result.output
    counts = instance_counts(run.records("results.jsonl"))
    band = load_tasks(tmp_path / "band")
    assert [t.instance_id for t in band] == [t.instance_id for t in load_tasks(root / "pool")]  # [0, 1]: all
    for task in band:   # the bundles travel with the rows, written relative to the task file
        assert task.repo_src.startswith(str((tmp_path / "band" / "repos").resolve()))
    assert all(not json.loads(line)["repo_src"].startswith("/")
               for line in (tmp_path / "band" / "tasks.jsonl").read_text().splitlines())
    summary = json.loads((tmp_path / "band" / BAND_FILE).read_text())
    assert summary["samples"] == 4 and summary["selected"] == 4
    assert summary["solve_rates"] == {iid: list(nc) for iid, nc in counts.items()}
    assert summary["mean_solve_rate"] == pytest.approx(sum(c / n for n, c in counts.values()) / 4)
    assert "4 of 4 tasks" in result.stdout

    # the band itself, on the real rates: exactly the tasks whose c/n lies inside
    inside = sorted(iid for iid, (n, c) in counts.items() if 0 < c < n)
    narrow = cli("tasks", "band", str(run.path), "--low", "0.01", "--high", "0.99", "--out", str(tmp_path / "narrow"))
    if inside:
        assert narrow.exit_code == 0, narrow.output
        assert sorted(t.instance_id for t in load_tasks(tmp_path / "narrow")) == inside
    else:
        assert narrow.exit_code == 2 and "widen the band" in narrow.output


def test_bad_input_exits_2_and_writes_nothing(sampled_eval, tmp_path):
    _, run = sampled_eval
    out = tmp_path / "band"
    assert cli("tasks", "band", str(run.path), "--low", "0", "--high", "1", "--out", str(out)).exit_code == 0
    before = (out / "tasks.jsonl").read_bytes()
    again = cli("tasks", "band", str(run.path), "--low", "0", "--high", "1", "--out", str(out))
    assert again.exit_code == 2 and "already holds a task set" in again.output
    assert (out / "tasks.jsonl").read_bytes() == before
    upside = cli("tasks", "band", str(run.path), "--low", "0.8", "--high", "0.2", "--out", str(tmp_path / "x"))
    assert upside.exit_code == 2 and "low <= high" in upside.output and not (tmp_path / "x").exists()
    missing = cli("tasks", "band", str(tmp_path / "nope"), "--out", str(tmp_path / "y"))
    assert missing.exit_code == 2 and not (tmp_path / "y").exists()
