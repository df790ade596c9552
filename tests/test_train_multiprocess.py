"""`crr train` across processes (data parallel, crr.train.distributed): a real `accelerate launch` of two CPU
processes (gloo), each rolling out its whole groups with its own local engine, against the same config in
one process: one run directory, the same trajectories count and tasks per update, one record per update,
no duplicate ledger or tuple rows, a finite logged loss; then resume after an interrupted update."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ran_task
from typer.testing import CliRunner

from crr.cli import app
from crr.policy.model import default_model_dir
from crr.tasks.loaders import write_tasks
from crr.train.tuples import read_tuples

ROOT = Path(__file__).resolve().parents[1]
# test_trainer.py's SMALL on two run-the-tests tasks: the random tiny model's returns differ between siblings
# there, so the updates carry real advantages and forks (on nano-band's tasks it scores 0 within 2 turns)
ARGS = ["--method", "crr", "--max-updates", "2", "n_tasks=2", "tasks_per_iteration=2", "num_generations=2",
        "max_turns=2", "max_new_tokens=40", "k=2", "eta=0.0", "workers=2", "warmup_steps=0",
        f"model={default_model_dir()}", "agent_format=paper"]



@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ran-tasks")
    return write_tasks([ran_task(root, "ran-1"), ran_task(root, "ran-2")], root / "tasks.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], processes: int = 2) -> str:
    """`accelerate launch --num_processes N -m crr ARGS` on CPU (--multi_gpu: accelerate's torchrun path,
    which the CPU preset's use_cpu turns into gloo processes) on this source tree."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "crr", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out.stdout


def records(run: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("event") == event]


@pytest.mark.slow   # ~2 min on 2 busy cores: one run in this process, two launches of two processes
def test_two_processes_match_one_and_resume(two_tasks, tmp_path):
    start = time.monotonic()
    single = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "one"), f"tasks={two_tasks}", *ARGS])
    assert single.exit_code == 0, single.output + repr(single.exception)
    one = next((tmp_path / "one").glob("*-train-*"))

    out = launch(["train", "--out", str(tmp_path / "two"), f"tasks={two_tasks}", *ARGS])
    runs = list((tmp_path / "two").glob("*-train-*"))
    assert len(runs) == 1, runs                          # one run directory, made by the main process
    run = runs[0]
    assert out.count("2/2 R") == 1 and out.count("done:") == 1   # the main process reports, once
    assert sorted(p.name for p in (run / "checkpoints" / "checkpoint-2").glob("rng_state_*")) == \
        ["rng_state_0.pth", "rng_state_1.pth"]          # two processes trained it

    ledger, ledger1 = (json.loads((r / "ledger.json").read_text()) for r in (run, one))
    assert [it["iteration"] for it in ledger["iterations"]] == [0, 1]
    assert all(it["processes"] == 2 and it["updates"] == 1 for it in ledger["iterations"])
    assert ledger["cumulative"]["trajectories"] == ledger1["cumulative"]["trajectories"] == 2 * 2 * 2
    assert ledger["cumulative"]["updates"] == 2
    iters, iters1 = records(run, "iteration"), records(one, "iteration")
    assert [r["step"] for r in iters] == [1, 2] and [r["iteration"] for r in records(run, "ledger")] == [0, 1]
    # the same tasks in each update, every group whole (G returns each)
    assert [sorted(r["group_rewards"]) for r in iters] == [sorted(r["group_rewards"]) for r in iters1]
    assert all(len(v) == 2 for r in iters for v in r["group_rewards"].values())
    assert sum(r["branches"] for r in iters) > 0
    trl = [r for r in records(run, "trl") if "loss" in r]
    assert [r["step"] for r in trl] == [1, 2] and all(math.isfinite(r["loss"]) for r in trl)

    tuples = read_tuples(run)
    assert len(tuples) == ledger["cumulative"]["forks"] > 0
    assert not tuples.duplicated(["iteration", "row", "t", "k_index"]).any()
    assert set(tuples["row"]) <= set(range(4))           # rows numbered across the processes' groups

    # An interruption during update 2: its checkpoint never written; two processes redo only that update.
    shutil.rmtree(run / "checkpoints" / "checkpoint-2")
    before = read_tuples(run)
    out2 = launch(["train", "--resume", str(run)])
    assert "2/2 R" in out2 and "1/2 R" not in out2
    assert list((tmp_path / "two").glob("*-train-*")) == [run]
    ledger = json.loads((run / "ledger.json").read_text())
    assert [it["iteration"] for it in ledger["iterations"]] == [0, 1] and ledger["cumulative"]["trajectories"] == 8
    assert [r["step"] for r in records(run, "iteration")] == [1, 2] and len(records(run, "resume")) == 1  # once each
    assert (run / "checkpoints" / "checkpoint-2").is_dir() and (run / "model" / "adapter_model.safetensors").is_file()
    after = read_tuples(run)
    assert len(after) == ledger["cumulative"]["forks"]
    cols = ["iteration", "row", "t", "realised_action", "counterfactual_action", "reward", "cf_reward"]
    assert before[cols].equals(after[cols])              # same seeds, restored weights: the same update again
    print(f"one process + two processes + resume: {time.monotonic() - start:.0f} s")


def test_processes_must_split_tasks_into_whole_groups(monkeypatch):
    from crr.errors import CRRError
    from crr.train.config import load_config

    monkeypatch.setenv("WORLD_SIZE", "2")   # as a launcher sets it; the error comes before any process group
    with pytest.raises(CRRError, match="not a multiple of the 2 processes"):
        load_config(None, {"tasks_per_iteration": 3})


def test_ledger_merge_sums_counts_and_keeps_one_update():
    from crr.train.ledger import COUNTS, PHASES, merge

    def rec(wall, n):
        return {"iteration": 4, **{k: wall / 2 for k in PHASES}, "wall_s": wall, **{k: n for k in COUNTS}, "updates": 1}

    one = rec(3.0, 5)
    assert merge([one]) is one                             # one process: its record, untouched
    both = merge([rec(2.0, 4), rec(4.0, 6)])
    assert both["trajectories"] == 10 and both["forks"] == 10 and both["updates"] == 1 and both["processes"] == 2
    assert both["wall_s"] == 4.0 and both["rollout_s"] == 1.5  # the slowest wall clock, the mean device's phases
