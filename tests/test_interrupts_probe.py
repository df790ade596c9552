"""Interrupts of real `crr` processes beyond tests/test_interrupt.py's one SIGTERM: Ctrl-C pressed again while the
first one cleans up, and a resume that needs more than the run directory (the command an interrupted run prints
must be the one that finishes its work)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import crr_process
from faults import descendants, interrupt, leftovers, survivors, wait_for_records

from crr.credit.audit import load_audit_config, parse_overrides, start_audit
from crr.policy.model import default_model_dir
from crr.rundir import RunDir, release_locks
from crr.tasks.micro import generate_micro

TINY = ["n_tasks=1", "group_size=2", "continuations=2", "repeats=1", "max_turns=2", "k=1", "eta=0.0", "cf_samples=1",
        "mc_samples=1", "bootstrap=50"]
TRAIN = ["n_tasks=1", "tasks_per_iteration=1", "num_generations=2", "max_turns=2", "max_new_tokens=40", "workers=2",
         "warmup_steps=0", f"model={default_model_dir()}", "agent_format=paper"]   # tests/test_trainer.py's SMALL


def started(proc: subprocess.Popen, settle_s: float = 0.5) -> str:
    """stderr up to the `run directory:` line, and `settle_s` more seconds (the command has named its resume)."""
    seen = ""
    while "run directory:" not in seen:
        line = proc.stderr.readline()
        assert line, seen + proc.communicate()[1]
        seen += line
    time.sleep(settle_s)
    return seen


def test_an_interrupted_addition_of_variants_names_them_in_its_resume(tmp_path):
    """Variants added to a recorded audit reach its config only once every record has them, so the resume an
    interrupted addition prints must carry them (before: `crr credit audit --resume RUN`, which ends at once with
    exit 0 and leaves the addition half done)."""
    run = start_audit(load_audit_config(None, parse_overrides(TINY)), tmp_path)
    release_locks()
    added = "variants={h1: {horizon: 1}}"
    proc = crr_process("credit", "audit", "--resume", str(run.path), added,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = started(proc)
    kids = descendants(proc.pid)
    kids_, err = interrupt(proc, signal.SIGINT)
    err = seen + err
    assert proc.returncode == 130, err
    hint = [line for line in err.splitlines() if line.startswith("interrupted (SIGINT)")]
    assert len(hint) == 1, err
    resume = shlex.split(hint[0].split("Resume with: ", 1)[1])
    assert resume == ["crr", "credit", "audit", "--resume", str(run.path), added], hint[0]
    assert survivors(kids | kids_) == [] and leftovers(proc.pid) == []


def test_ctrl_c_again_while_the_first_cleans_up_leaves_nothing_and_exits_130(tmp_path):
    """An impatient user's Ctrl-C, again and again until the process is gone: the first one's cleanup runs to its
    end (before: the next one raised inside it: exit by SIGINT (-2) after the interrupt line or a traceback, the
    engine's sandbox directory and pids cgroup left for the next command to reclaim)."""
    tasks = tmp_path / "tasks"
    generate_micro(tasks, n=2, seed=3, split="train")
    proc = crr_process("filter-tasks", "--tasks", str(tasks), "--workers", "1", "--out", str(tmp_path / "runs"),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_for_records("*/results.jsonl", tmp_path / "runs", proc)
    kids = descendants(proc.pid)
    while proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
    err = proc.communicate()[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.count("interrupted (SIGINT)") == 1, err
    assert f"Resume with: crr filter-tasks --resume {run}" in err
    assert survivors(kids) == [] and leftovers(proc.pid) == []
    resumed = crr_process("filter-tasks", "--resume", str(run), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    err = resumed.communicate(timeout=120)[1]
    assert resumed.returncode == 0, err
    ids = sorted(r["instance_id"] for r in RunDir.open(run).records("results.jsonl"))
    expected = sorted(json.loads(line)["instance_id"] for line in (tasks / "tasks.jsonl").read_text().splitlines())
    assert ids == expected, "a task decided twice or never"


def test_a_train_run_stopped_before_its_eval_before_exists_names_eval_in_its_resume(ran_tasks_file, tmp_path):
    """A resume learns --eval from the run's eval-before/ evaluation; stopped before that exists (its task set
    still loading: a large one takes seconds), the resume printed must say --eval again (before: `crr train
    --resume RUN`, which trained to the end and exited 0 without the held-out evaluation before or after)."""
    row = json.loads(ran_tasks_file.read_text())
    held_out = tmp_path / "held-out.jsonl"   # large enough that loading it keeps eval-before/ empty a while
    held_out.write_text("".join(json.dumps({**row, "instance_id": f"ran-{i}"}) + "\n" for i in range(20000)))
    proc = crr_process("train", "--method", "grpo", "--out", str(tmp_path / "runs"), "--max-updates", "1",
                       "--eval", str(held_out), "--eval-n", "1", f"tasks={ran_tasks_file}", *TRAIN,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = started(proc, settle_s=0.2)
    run = seen.split("run directory: ", 1)[1].split()[0]
    kids_, err = interrupt(proc, signal.SIGINT)
    err = seen + err
    assert proc.returncode == 130, err
    assert not list((tmp_path / "runs").glob("*/eval-before/*/manifest.json")), "eval-before/ was made: too late"
    hint = [line for line in err.splitlines() if line.startswith("interrupted (SIGINT)")]
    assert len(hint) == 1, err
    resume = shlex.split(hint[0].split("Resume with: ", 1)[1])
    assert resume == ["crr", "train", "--resume", run, "--eval", str(held_out), "--eval-n", "1"], hint[0]
    assert survivors(kids_) == [] and leftovers(proc.pid) == []


def test_a_held_out_set_of_infrastructure_failures_reports_no_rate_instead_of_a_traceback(ran_tasks_file, tmp_path):
    """--eval whose every sample is an infrastructure failure (here a task whose repository is gone) has no pass
    rate: it says so and the run ends (before: a TypeError traceback, exit 1, after the evaluation before training)."""
    row = json.loads(ran_tasks_file.read_text())
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text(json.dumps({**row, "instance_id": "gone", "repo_src": str(tmp_path / "gone")}) + "\n")
    proc = crr_process("train", "--method", "grpo", "--out", str(tmp_path / "runs"), "--max-updates", "1",
                       "--eval", str(held_out), f"tasks={ran_tasks_file}", *TRAIN,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "pass@1 before training (held-out, greedy, 1 tasks): - (1 infrastructure" in out
    assert "held-out pass@1" in out and "before - -> after -" in out, out


def test_a_ctrl_c_inside_code_made_by_exec_still_exits_130(tmp_path):
    """A Ctrl-C that lands while dataclasses or namedtuple run the source they generate (an import in progress)
    is caught like any other (before: Python 3.11 run as `python -m crr` then exited by SIGINT (-2) after the
    interrupt line, cpython gh-128130; CI saw it once in `crr credit audit`)."""
    (tmp_path / "stopped_in_exec.py").write_text(
        "import typer\nfrom crr.cli.common import friendly\n"
        "@friendly\ndef command():\n    exec('raise KeyboardInterrupt')\n"
        "try:\n    command()\nexcept typer.Exit as e:\n    raise SystemExit(e.exit_code)\n")
    source = Path(__file__).resolve().parent.parent   # this source tree's crr, as crr_process runs it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(source)])}
    done = subprocess.run([sys.executable, "-m", "stopped_in_exec"], capture_output=True, text=True, timeout=120,
                          env=env, check=False)   # `-m`, as crr_process runs `python -m crr`
    assert done.returncode == 130, done.stderr
    assert done.stderr.startswith("interrupted (SIGINT); stopped"), done.stderr


def test_an_interrupt_inside_an_import_lands_once_the_import_has_ended(tmp_path):
    """A SIGINT or SIGTERM that lands while a module is being imported raises after the import, not inside it
    (before: CI's `crr credit audit`, given Ctrl-C while importing torch, raised inside torch's native `_c10d_init`
    and the process aborted with SIGABRT (-6), `terminate called after throwing an instance of 'pybind11::...'`,
    with no cleanup and no resume line). A module that sends itself SIGTERM (SIGINT is ignored by the test
    workers' children) finishes its import and the command's next one, and the command is interrupted in its next
    step."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.5)\nIMPORTED = True\n")
    (tmp_path / "next_module.py").write_text("import time\ntime.sleep(0.5)\nIMPORTED = True\n")
    (tmp_path / "interrupted_in_import.py").write_text(
        "import sys, time, typer\nfrom crr.cli.common import friendly\n"
        "@friendly\ndef command():\n    try:\n        import slow_module\n        import next_module\n"
        "    except KeyboardInterrupt:\n        print('raised inside the import', flush=True)\n        raise\n"
        "    print('imported', flush=True)\n    time.sleep(100)\n    print('never interrupted', flush=True)\n"
        "try:\n    command()\nexcept typer.Exit as e:\n    raise SystemExit(e.exit_code)\n")
    source = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(source)])}
    done = subprocess.run([sys.executable, "-m", "interrupted_in_import"], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 143, done.stdout + done.stderr
    assert done.stdout == "imported\n", done.stdout
    assert done.stderr.startswith("interrupted (SIGTERM); stopped"), done.stderr
