"""Bad command-line input: refused before any work (before a run directory, a lookup or a benchmark), as one line
and exit 2, never a traceback."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from crr.bench.fork import fork_bench
from crr.cli import app
from crr.doctor import run_checks
from crr.errors import CRRError, TaskFormatError
from crr.rundir import RunDir, release_locks
from crr.tasks.loaders import read_tasks_jsonl, write_tasks
from crr.tasks.synth import PackageSpec, parse_package, synthesise
from crr.train.tuples import write_part


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


def test_a_script_that_is_not_utf8_is_a_one_line_error(tmp_path):
    script = tmp_path / "calls.jsonl"
    script.write_bytes(b'{"name": "run_tests", "arguments": {}}\n\xff\xfe\n')
    result = CliRunner().invoke(app, ["tool", "--tasks", "micro-test", "--instance", "x", "--script", str(script)])
    assert result.exit_code == 2 and "UTF-8" in result.output, result.output


def test_a_task_file_that_is_not_utf8_names_its_line(tmp_path, task):
    path = write_tasks([task], tmp_path / "tasks.jsonl")
    path.write_bytes(path.read_bytes() + b"\xff\n")
    with pytest.raises(TaskFormatError, match=r"tasks.jsonl:2: not UTF-8"):
        read_tasks_jsonl(path)


@pytest.mark.parametrize("option, value, message", [
    ("--max-turns", "0", "max_turns must be at least 1"),
    ("--temperature", "nan", "temperature must be a finite number"),
    ("--temperature", "-1", "temperature must be a finite number"),
    ("--workers", "0", "workers must be at least 1"),
    ("--seed", "-1", "seed must be >= 0"),
])
def test_rollout_refuses_bad_settings_before_making_a_run_directory(task, tmp_path, option, value, message):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    result = CliRunner().invoke(app, ["rollout", "--tasks", str(tasks), "--n", "1", "--group-size", "1",
                                      "--out", str(tmp_path / "runs"), option, value])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_replay_verify_refuses_a_seed_it_cannot_sample_with(tmp_path, seed):
    run = RunDir.create("train", root=tmp_path, config={"tasks": "micro-test"})
    write_part(run.path, 0, [{"task_id": "micro-test-0-0", "iteration": 0, "t": 0, "cf_reward": 1.0}])
    release_locks()
    result = CliRunner().invoke(app, ["replay", "verify", str(run.path), "--seed", seed])
    assert result.exit_code == 2 and "--seed" in result.output, result.output


def test_a_package_name_that_is_not_a_name_is_refused():
    with pytest.raises(CRRError, match="not a valid package name"):
        parse_package("foo bar==1.0")


def test_a_package_named_twice_is_refused_before_anything_is_written(tmp_path):
    specs = [PackageSpec("inflection", "0.5.1"), PackageSpec("Inflection", "0.5.1")]
    with pytest.raises(CRRError, match="named twice"):
        synthesise(specs, tmp_path / "s", n=1)
    assert not (tmp_path / "s").exists()


def test_fork_bench_takes_an_engine_class_by_dotted_path():
    result = fork_bench("toy_engine:ToyEngine", n_files=20, repeats=1)
    assert result["exact"] and result["fork_ms_p50"] > 0
    with pytest.raises(CRRError, match="has no modes"):
        fork_bench("toy_engine:ToyEngine", mode="both", n_files=20, repeats=1)


def test_crr_tool_says_which_calls_of_a_script_it_did_not_play(tmp_path, task):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    script = tmp_path / "calls.jsonl"
    script.write_text('{"name": "submit_patch", "arguments": {}}\n{"name": "run_tests", "arguments": {}}\n')
    result = CliRunner().invoke(app, ["tool", "--tasks", str(tasks), "--instance", task.instance_id,
                                      "--script", str(script), "--json"])
    assert result.exit_code == 0, result.output
    assert "1 call after submit_patch not played" in result.stderr


def test_doctor_reports_a_cache_directory_it_cannot_make(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CRR_CACHE_DIR", str(tmp_path / "file"))
    check = next(c for c in run_checks() if c.name == "free disk")
    assert not check.ok and "CRR_CACHE_DIR" in check.fix


@pytest.mark.parametrize("option", ["--group-size", "--max-turns", "--max-new-tokens"])
def test_rollout_bench_refuses_bad_throughput_settings_before_the_fork_bench(monkeypatch, option):
    import crr.bench.rollout

    def fork_bench(*args, **kwargs):
        raise AssertionError("the fork bench ran before the settings were checked")

    monkeypatch.setattr(crr.bench.rollout, "fork_bench", fork_bench)
    result = CliRunner().invoke(app, ["rollout", "bench", option, "0"])
    assert result.exit_code == 2 and "must be at least 1" in result.output, result.output


def test_tasks_show_refuses_a_negative_limit(tmp_path, task):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    result = CliRunner().invoke(app, ["tasks", "show", str(tasks), "--limit", "-1"])
    assert result.exit_code == 2 and "--limit" in result.output, result.output


def test_rollout_of_an_empty_task_file_makes_no_run_directory(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("\n")
    result = CliRunner().invoke(app, ["rollout", "--tasks", str(tmp_path / "tasks.jsonl"),
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "holds no tasks" in result.output, result.output
    assert not (tmp_path / "runs").exists()


def test_a_requirement_that_is_not_one_is_refused_before_any_lookup():
    with pytest.raises(CRRError, match="--requires 'not a req!!' is not a requirement"):
        parse_package("inflection==0.5.1", ("not a req!!",))
