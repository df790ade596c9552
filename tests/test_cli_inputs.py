"""Bad command-line input: refused before any work, as one line and exit 2."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from crr.cli import app


def _refused(args: list[str]) -> str:
    """The one error line of a command refused with exit 2."""
    result = CliRunner().invoke(app, args)
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    return lines[0]


def test_model_generate_caps_n(tmp_path):
    """--n is one batch: a huge one is refused before the model loads (here none could be)."""
    line = _refused(["model", "generate", "--model", str(tmp_path / "no-model"), "--prompt", "hi",
                     "--n", "100000"])
    assert line == "error: --n must be between 1 and 64, got 100000"


@pytest.mark.parametrize("args", [["demo", "--engine", "no-such-engine"], ["tasks", "micro", "--n", "0"]],
                         ids=["run-directory", "task-set"])
def test_an_empty_out_is_refused_not_the_working_directory(args, tmp_path, monkeypatch):
    """An empty --out would be the working directory (each command's other input is bad too, so that nothing
    is written there without the check either)."""
    monkeypatch.chdir(tmp_path)
    line = _refused([*args, "--out", ""])
    assert line.startswith("error: --out is empty"), line
    assert list(tmp_path.iterdir()) == []


def test_tasks_synth_refuses_requires_without_package(tmp_path):
    line = _refused(["tasks", "synth", "--curated", "--requires", "hypothesis==6.100.0",
                     "--engine", "no-such-engine", "--out", str(tmp_path / "s")])
    assert line == ("error: --requires is for --package only (a curated package's requirements are in "
                    "crr/tasks/packages.yaml)")
    assert not (tmp_path / "s").exists()


def _commands(group, path=()):
    """Every command and group (a group such as filter-tasks takes options of its own) under `group`."""
    for name, command in group.commands.items():
        yield " ".join((*path, name)), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


def test_every_out_option_refuses_an_empty_path():
    """Every command's --out goes through out_option's parser: given first, it is refused before the command's
    other (here missing) input is looked at."""
    names = [name for name, command in _commands(typer.main.get_command(app))
             if any("--out" in p.opts for p in command.params)]
    assert len(names) >= 10, names
    for name in names:
        assert _refused([*name.split(), "--out", ""]).startswith("error: --out is empty"), name
