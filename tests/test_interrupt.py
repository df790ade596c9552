"""Fault injection on real `crr` processes: SIGTERM mid-run (what Slurm, Kubernetes and `timeout` send)
and SIGKILL, on the local and the Docker engine. Nothing of a stopped process survives it (processes,
containers, snapshot images, mounts, sandbox directories) once it or the next command is done; the
resumed run decides every task exactly once; a run directory has one writer at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import crr_process
from faults import ENGINES, interrupt, leftovers, survivors, wait_for_records

from crr.policy.model import default_model_dir
from crr.rundir import RunDir
from crr.tasks.micro import generate_micro

EVAL = ("--max-turns", "2", "--max-new-tokens", "32", "--workers", "2", "--batch", "2")


@pytest.fixture(scope="module")
def micro_tasks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interrupt") / "tasks"
    generate_micro(out, n=6, seed=3, split="train")
    return out


@pytest.fixture(params=list(ENGINES), ids=list(ENGINES))
def engine(request) -> str:
    if request.param == "docker":
        request.applymarker(pytest.mark.docker)
    return request.param


def run_crr(*args: str) -> subprocess.CompletedProcess:
    proc = crr_process(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def decided_once(run: Path, tasks: Path) -> None:
    ids = [r["instance_id"] for r in RunDir.open(run).records("results.jsonl")]
    expected = [json.loads(line)["instance_id"] for line in (tasks / "tasks.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(expected), "a task decided twice or never"


def test_sigterm_mid_filter_leaves_nothing_and_the_resume_decides_every_task_once(engine, micro_tasks, tmp_path):
    proc = crr_process("filter-tasks", "--tasks", str(micro_tasks), "--out", str(tmp_path), *ENGINES[engine],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_for_records("*/results.jsonl", tmp_path, proc)
    kids, err = interrupt(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"interrupted (SIGTERM); finished work is kept. Resume with: crr filter-tasks --resume {run}" in err
    assert "infra error" not in err, err   # sandboxes closed by the shutdown are no verifier failure
    assert survivors(kids) == [] and leftovers(proc.pid) == []
    assert len(RunDir.open(run).records("results.jsonl")) < 6
    resumed = run_crr("filter-tasks", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    decided_once(run, micro_tasks)


def test_sigterm_mid_eval_leaves_nothing_and_the_resume_runs_every_sample_once(engine, micro_tasks, tmp_path):
    model = str(default_model_dir())
    proc = crr_process("eval", "tasks", str(micro_tasks), "--model", model, "--out", str(tmp_path), *EVAL,
                       *ENGINES[engine][:2], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_for_records("*/results.jsonl", tmp_path, proc)
    kids, err = interrupt(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"Resume with: crr eval --resume {run}" in err
    assert "Warning" not in err and "it/s" not in err  # transformers' warnings and bars are in the run's log
    assert survivors(kids) == [] and leftovers(proc.pid) == []
    resumed = run_crr("eval", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    decided_once(run, micro_tasks)


@pytest.mark.serial
def test_a_second_writer_is_refused_and_a_killed_writers_run_resumes(engine, micro_tasks, tmp_path):
    first = crr_process("filter-tasks", "--tasks", str(micro_tasks), "--out", str(tmp_path), *ENGINES[engine],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_for_records("*/results.jsonl", tmp_path, first)
    second = run_crr("filter-tasks", "--resume", str(run))
    assert second.returncode == 2
    assert second.stderr.splitlines() == [f"error: {run} is in use by crr process {first.pid} (`crr filter-tasks` "
                                          f"on {os.uname().nodename}): a run directory has one writer at a time; "
                                          "wait for it to end or stop it, then resume"]
    assert RunDir.open(run).records("results.jsonl")  # reading it is fine
    kids, _ = interrupt(first, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL
    assert leftovers(first.pid), "SIGKILL leaves what only the process could free (until the next command)"
    resumed = run_crr("filter-tasks", "--resume", str(run))  # the kernel dropped the lock with its owner
    assert resumed.returncode == 0, resumed.stderr
    assert survivors(kids) == [] and leftovers(first.pid) == []  # reclaimed by the resume, at its start
    decided_once(run, micro_tasks)
