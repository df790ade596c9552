"""What the CLI prints off a terminal: messages whole, one line each, whatever the width."""

from __future__ import annotations

import logging
import subprocess
import warnings
from pathlib import Path

from conftest import crr_process
from typer.testing import CliRunner

from crr import cli
from crr.cli import app
from crr.rundir import RUN_LOG, RunDir, release_locks


def test_an_error_off_a_terminal_is_one_line_whatever_the_width(tmp_path):
    deep = tmp_path / ("a-rather-long-directory-name-" * 4) / "not-a-run"
    deep.mkdir(parents=True)
    message = f"error: {deep} is not a crr run directory (no manifest.json); pass a directory made by a crr command"
    for columns in ("20", "80", "200"):
        proc = crr_process("replay", "verify", str(deep), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={"COLUMNS": columns})
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and out == ""
        assert err.splitlines() == [message], (columns, err)


def test_messages_in_captured_output_are_not_broken_at_the_console_width(tmp_path):
    result = CliRunner().invoke(app, ["replay", "verify", str(tmp_path / ("x" * 60))])
    assert result.exit_code == 2
    assert f"{tmp_path / ('x' * 60)} is not a crr run directory" in result.output.splitlines()[0]


def test_an_out_path_that_cannot_be_a_directory_is_one_line_and_exit_2(tmp_path):
    """--out naming a file, or a path under one: the user's to fix, so one line with the path, no traceback."""
    runs = Path(__file__).resolve().parents[1] / "results" / "reference" / "cpu-main"   # committed, real runs
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for out, reason in ((a_file, "File exists"), (a_file / "report", "Not a directory")):
        result = CliRunner().invoke(app, ["report", "tables", "--runs", str(runs), "--out", str(out)])
        lines = result.output.splitlines()
        assert result.exit_code == 2 and lines == [f"error: {out}: {reason}"], result.output
    assert a_file.read_text() == "mine\n"
    result = CliRunner().invoke(app, ["demo", "--out", "/proc/crr-out"])   # a place where nothing can be made
    assert result.exit_code == 2 and result.output.startswith("error: cannot make the run directory /proc/crr-out/")
    assert len(result.output.splitlines()) == 1, result.output


def test_library_warnings_and_records_go_to_the_run_log_and_crrs_own_to_the_terminal(tmp_path, capsys):
    with cli._library_output():
        warnings.warn("early library warning", FutureWarning, stacklevel=1)  # before the command has a run directory
        logging.getLogger("transformers.modeling_utils").warning("a library record")
        logging.getLogger("crr.train").warning("crr's own warning")
        run = RunDir.create("test", root=tmp_path)
        warnings.warn("late library warning", FutureWarning, stacklevel=1)
        logging.getLogger("crr.rollout").info("crr's own progress record")
    release_locks()
    log = (run.path / RUN_LOG).read_text()
    for said in ("early library warning", "a library record", "crr's own warning", "late library warning",
                 "crr's own progress record"):
        assert said in log
    assert capsys.readouterr().err == "warning: crr's own warning\n"
    logging.getLogger("transformers").warning("after the command")  # the routing ends with it
    assert "after the command" not in (run.path / RUN_LOG).read_text()


def test_a_command_without_a_run_directory_prints_its_library_warnings_at_the_end(capsys):
    with cli._library_output():
        warnings.warn("a library warning", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == ""
    assert "a library warning" in capsys.readouterr().err


def test_freed_leftovers_are_said_once_a_run_is_written_and_never_before_a_refused_input(tmp_path, monkeypatch,
                                                                                         ran_tasks_file):
    from crr.sandbox.local import reclaim
    from crr.sandbox.local.common import _PREFIX, OWNER_FILE

    sandboxes = tmp_path / "sandboxes"  # this test's own, so that no other test's command frees its leftovers
    monkeypatch.setattr(reclaim, "default_workdir", lambda: sandboxes)

    def leftover(name: str):
        (sandboxes / f"{_PREFIX}{name}").mkdir(parents=True)
        (sandboxes / f"{_PREFIX}{name}" / OWNER_FILE).write_text('{"pid": 2147483646, "start": 1}')  # no such pid
        return sandboxes / f"{_PREFIX}{name}"

    dead = leftover("refused")
    refused = CliRunner().invoke(app, ["filter-tasks", "--tasks", str(ran_tasks_file), "--engine", "local",
                                       "--ray", "auto", "--out", str(tmp_path / "runs")])
    release_locks()
    lines = refused.output.strip().splitlines()
    assert refused.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), refused.output
    assert not dead.exists() and not (tmp_path / "runs").exists()  # freed all the same, silently

    dead = leftover("ran")
    ran = CliRunner().invoke(app, ["filter-tasks", "--tasks", str(ran_tasks_file), "--reruns", "2",
                                   "--out", str(tmp_path / "runs")])
    release_locks()
    assert ran.exit_code == 0, ran.output
    said = [line for line in ran.output.splitlines() if line.startswith("reclaimed ")]
    assert not dead.exists() and len(said) == 1, ran.output  # (with any dead process's cgroups on this host)
    (run,) = (tmp_path / "runs").iterdir()
    assert str(dead) in (run / RUN_LOG).read_text()


def test_bad_input_found_inside_the_work_leaves_no_progress_bar_above_its_error(tmp_path):
    """`crr tasks micro` checks its input inside the generation its bar follows: a refusal before the bar has moved
    is the error line alone, off a terminal and on one (where the bar that was drawn is erased)."""
    proc = crr_process("tasks", "micro", "--n", "0", "--out", str(tmp_path / "t"), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out == ""
    assert err.splitlines() == ["error: --n must be at least 1, got 0"], err
    assert not (tmp_path / "t").exists()


def test_sandbox_gc_without_a_docker_daemon_says_what_gc_can_do(monkeypatch):
    """gc takes no --engine: its hint for a daemon it cannot reach is to start it, not to pick another engine."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    result = CliRunner().invoke(app, ["sandbox", "gc", "--dry-run"])
    skipped = next(line for line in result.output.splitlines() if line.startswith("docker:"))
    assert result.exit_code == 0 and "skipped" in skipped and "start it (dockerd)" in skipped, result.output
    assert "--engine" not in result.output, result.output
