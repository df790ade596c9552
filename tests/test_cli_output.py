"""What the CLI prints off a terminal: messages whole, one line each, whatever the width."""

from __future__ import annotations

import subprocess

from conftest import crr_process
from typer.testing import CliRunner

from crr.cli import app


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
