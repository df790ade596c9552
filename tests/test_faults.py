"""Bad input and faults end as one line naming what is wrong (exit 2), before anything is made or after nothing
is lost: every field of the train config type- and range-checked before a run directory exists; corrupt run
files (ledger.json, metrics.jsonl, a tuples part, an evaluation's config.yaml); a full disk (a real tmpfs filled
up) and a read-only one (a real read-only remount). Nothing here trains or runs a model."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.eval.evaluate import EvalConfig
from crr.rundir import RunDir, append_jsonl, release_locks
from crr.train.config import load_config
from crr.train.trainer import start_run
from crr.train.tuples import part_path, read_tuples, write_part

# value -> what the one-line error says (before: tracebacks, silent acceptance, or a failure 100 s in)
BAD_VALUES = {
    "learning_rate=abc": "learning_rate='abc': expected a number",
    "num_generations=0": "num_generations=0: must be >= 2",
    "seed=abc": "seed='abc': expected an integer",
    "lora_r=0": "lora_r=0: must be >= 1",
    "beta=-1": "beta=-1: must be >= 0",
    "budget_hours=-1": "budget_hours=-1: must be > 0",
    "n_tasks=0": "n_tasks=0: must be >= 1",
    "max_trajectories=0": "max_trajectories=0: must be >= 1",
    "temperature=0": "temperature=0: must be > 0",
    "rollout_temperature=0": "rollout_temperature=0: must be > 0",
    "rollout_temperature=.inf": "rollout_temperature=inf: expected a finite number",
    "learning_rate=.nan": "learning_rate=nan: expected a finite number",
    "use_lora=maybe": "use_lora='maybe': expected true or false",
    "dtype=float16": "dtype='float16': expected one of auto, float32, bfloat16",
    "max_steps=0": "max_steps=0: must be >= 1 (or -1: unset)",
    "checkpoint_fractions=[0.5,2]": "checkpoint_fractions=[0.5, 2]: must be in (0, 1]",
    "model=/nonexistent/model": "model=/nonexistent/model: no such directory",
}


def crr(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, list(args))
    release_locks()
    return result.exit_code, result.output.strip().splitlines()


def one_error(code: int, lines: list[str], *fragments: str) -> None:
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_bad_train_values_are_refused_before_a_run_directory_exists(tmp_path, ran_tasks_file):
    out = tmp_path / "runs"
    for value, message in BAD_VALUES.items():
        one_error(*crr("train", "--out", str(out), f"tasks={ran_tasks_file}", value), message)
    one_error(*crr("train", "--out", str(out), f"tasks={ran_tasks_file}", "lr_scheduler_type=bogus"),
              "invalid config: bogus is not a valid SchedulerType")   # TRL's own checks (after crr's): one line too
    (tmp_path / "empty").mkdir()
    one_error(*crr("train", "--out", str(out), f"model={tmp_path / 'empty'}"), "that directory holds no model")
    one_error(*crr("train", "--out", str(out), f"tasks={ran_tasks_file}", "tasks_per_iteration=2"),
              "has 1 tasks, fewer than tasks_per_iteration=2")
    assert not out.exists()   # nothing left behind by a refused run


def test_malformed_yaml_is_one_line_naming_the_file_or_the_override(tmp_path):
    """A preset, comparison spec, recipe or override that is not YAML: where the parser stopped, not a traceback."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("k: [1,\n")
    where = f"{bad}:2:1: not valid YAML (expected the node content"
    for command in (["train", "--config", str(bad)], ["credit", "audit", "--config", str(bad)],
                    ["sft", "--recipe", str(bad)], ["experiment", "run", str(bad), "--dry-run"]):
        one_error(*crr(*command), where)
    one_error(*crr("train", "engine_options={foo: 1"), "override 'engine_options={foo: 1': the value is not valid YAML")
    one_error(*crr("credit", "audit", "continuations=[1,"), "override 'continuations=[1,': the value is not valid YAML")


def test_inputs_that_would_do_nothing_or_write_into_a_file_are_one_line(tmp_path):
    """An empty tool script (without --verify) and a comparison's --out that is a file, even for --dry-run, which
    planned its runs under the file."""
    script, a_file = tmp_path / "calls.json", tmp_path / "notes.txt"
    script.write_text("[]")
    a_file.write_text("mine\n")
    one_error(*crr("tool", "--tasks", "nano-val", "--instance", "x", "--script", str(script)),
              f"{script} holds no tool calls")
    spec = Path(__file__).resolve().parents[1] / "experiments" / "cpu-main.comparison.yaml"
    one_error(*crr("experiment", "run", str(spec), "--dry-run", "--out", str(a_file)), f"{a_file} is a file")
    assert a_file.read_text() == "mine\n"


@pytest.fixture
def train_run(tmp_path, ran_tasks_file) -> Path:
    """A train run directory as `crr train` makes it before its first update (no training)."""
    run = start_run(load_config(None, {"tasks": str(ran_tasks_file), "n_tasks": 1, "tasks_per_iteration": 1,
                                       "output_dir": str(tmp_path)}), tmp_path / "runs")
    release_locks()
    return run.path


def test_corrupt_run_files_are_one_line_naming_the_file(train_run, tmp_path):
    (train_run / "ledger.json").write_text("{garbage")
    one_error(*crr("train", "--resume", str(train_run)), f"{train_run / 'ledger.json'} is corrupt (not JSON")
    (train_run / "ledger.json").write_text('{"iterations": [1, 2]}')
    one_error(*crr("train", "--resume", str(train_run)), f"{train_run / 'ledger.json'} is corrupt")
    (train_run / "ledger.json").unlink()

    append_jsonl(train_run / "metrics.jsonl", {"event": "iteration", "step": 1})
    with open(train_run / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n")
    one_error(*crr("train", "--resume", str(train_run)), f"{train_run / 'metrics.jsonl'}:2: a list, not a JSON object")
    (train_run / "metrics.jsonl").unlink()

    row = {"task_id": "x", "iteration": 0, "t": 0, "prefix_actions": [], "counterfactual_suffix": ["a"], "reward": 1.0,
           "cf_reward": 0.0}
    part = write_part(train_run, 0, [row])
    assert len(read_tuples(train_run)) == 1
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])   # half a part
    one_error(*crr("replay", "verify", str(train_run)), f"{part_path(train_run, 0)} is corrupt (not a whole parquet")

    evaluation = RunDir.create("eval", "x", root=tmp_path / "evals",
                               config=dataclasses.asdict(EvalConfig(dataset="x", tasks="x", model="m")))
    release_locks()
    (evaluation.path / "config.yaml").unlink()
    one_error(*crr("eval", "--resume", str(evaluation.path)), f"{evaluation.path / 'config.yaml'} is missing")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Path:
    """A real tmpfs of `size` at `path` (root only: mount(2))."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; a full and a read-only disk are tested as root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path, leave: int = 0) -> None:
    """Fill the filesystem of `path` up, then free `leave` bytes."""
    with open(path / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        f.truncate(max(0, f.seek(0, os.SEEK_END) - leave))


def test_a_full_or_read_only_disk_is_one_line_and_loses_nothing(tmp_path, ran_tasks_file):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        run = start_run(load_config(None, {"tasks": str(ran_tasks_file), "n_tasks": 1, "tasks_per_iteration": 1,
                                           "output_dir": str(disk)}), disk / "runs")
        release_locks()
        log = run.path / "metrics.jsonl"
        append_jsonl(log, {"event": "iteration", "step": 1})
        whole = log.read_bytes()
        fill(disk)
        # ENOSPC: an append is cut back to the last whole record; a whole-file write keeps the old file
        with pytest.raises(OSError) as e:
            append_jsonl(log, {"event": "iteration", "step": 2, "pad": "x" * 8192})
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(log) and log.read_bytes() == whole
        one_error(*crr("train", "--resume", str(run.path)), f"{run.path}/", ": No space left on device")
        assert log.read_bytes() == whole and not list(run.path.glob(".*.tmp"))
        # a new run on a full disk: one line, and no run directory left
        code, lines = crr("train", "--out", str(disk / "more"), f"tasks={ran_tasks_file}", "n_tasks=1",
                          "tasks_per_iteration=1")
        one_error(code, lines, "No space left on device")
        assert not list((disk / "more").glob("*-train-*"))

        (disk / "filler").unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        one_error(*crr("train", "--resume", str(run.path)), f"{run.path / '.lock'}: Read-only file system")
        one_error(*crr("train", "--out", str(disk / "ro"), f"tasks={ran_tasks_file}", "n_tasks=1",
                       "tasks_per_iteration=1"), f"{disk / 'ro'}", "Read-only file system")
        assert log.read_bytes() == whole and json.loads(whole)["step"] == 1


def test_a_sample_whose_transcript_write_failed_is_run_again_on_resume(tmp_path, monkeypatch):
    """crr eval appends a sample's transcript before its result: a refused transcript write leaves no result,
    so the resume runs that sample again and every result has its transcript (the tiny policy, one task)."""
    from crr import rundir
    from crr.eval.evaluate import RESULTS, TRANSCRIPTS

    real, refused = rundir.append_jsonl, []

    def full_at_first_transcript(path: Path, record: dict) -> None:
        if path.name == TRANSCRIPTS and not refused:
            refused.append(path)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, record)

    monkeypatch.setattr(rundir, "append_jsonl", full_at_first_transcript)
    code, lines = crr("eval", "micro", "--n-tasks", "1", "--max-turns", "2", "--max-new-tokens", "32", "--dtype",
                      "float32", "--out", str(tmp_path))
    (run,) = tmp_path.glob("*-eval-*")
    assert code == 2 and lines[-1].startswith(f"error: {run / TRANSCRIPTS}: No space left on device; finished work "
                                              f"is kept: make room (or make it writable), then resume with: crr eval")
    assert RunDir.open(run).records(RESULTS) == []
    monkeypatch.undo()
    code, lines = crr("eval", "--resume", str(run))
    assert code == 0, lines
    keys = lambda name: [(r["instance_id"], r["sample"]) for r in RunDir.open(run).records(name)]
    assert len(keys(RESULTS)) == 1 and keys(TRANSCRIPTS) == keys(RESULTS)


def test_a_disk_full_at_a_checkpoint_publishes_nothing_and_the_resume_redoes_the_update(tmp_path, ran_tasks_file):
    """A real update whose checkpoint save meets a full disk (a tmpfs filled up once the update is logged): one
    line naming the checkpoint, no torn checkpoint-1 and no staging left; the resume starts over with every
    record of the lost update cut (it will be redone)."""
    from test_trainer import SMALL

    from crr.errors import CRRError
    from crr.train.config import parse_overrides
    from crr.train.trainer import CHECKPOINTS, resume_run, train

    with tmpfs(tmp_path / "disk", "64m") as disk:
        cfg = load_config(None, {**parse_overrides([*SMALL, f"tasks={ran_tasks_file}", "max_steps=1"]),
                                 "method": "grpo", "output_dir": str(disk)})
        run = start_run(cfg, disk / "runs")
        checkpoint = run.path / CHECKPOINTS / "checkpoint-1"
        with pytest.raises(CRRError, match=rf"^cannot save {checkpoint}: .* \(0 MiB free there\)$"):
            train(cfg, run, on_iteration=lambda record: fill(disk, leave=64 * 1024))   # room for the records only
        release_locks()
        assert not checkpoint.exists() and not (run.path / CHECKPOINTS / ".staging").exists()
        assert [r["step"] for r in run.records("metrics.jsonl") if r.get("event") == "iteration"] == [1]
        (disk / "filler").unlink()
        _, _, resumed_from = resume_run(run.path)
        release_locks()
        assert resumed_from is None
        assert not [r for r in run.records("metrics.jsonl") if r.get("event") in ("iteration", "trl", "ledger")]
        assert json.loads((run.path / "ledger.json").read_text())["iterations"] == []
