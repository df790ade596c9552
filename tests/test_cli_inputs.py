"""Bad command-line input: refused before any work (before a run directory, a lookup or a benchmark), as one line
and exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import crr_process
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
    ("--seed", "-1", "greater than or equal to 0"),
])
def test_rollout_refuses_bad_settings_before_making_a_run_directory(task, tmp_path, option, value, message):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    result = CliRunner().invoke(app, ["rollout", "--tasks", str(tasks), "--n", "1", "--group-size", "1",
                                      "--out", str(tmp_path / "runs"), option, value])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [["eval", "micro"], ["sft"], ["rollout"],
                                     ["filter-tasks", "--tasks", "micro-test"]])
def test_a_seed_no_stream_takes_is_refused_as_it_is_parsed(command, tmp_path):
    # (eval and sft took -1 as far as their first draw: a traceback, with the run directory made)
    for seed in ("-1", str(2 ** 32)):
        result = CliRunner().invoke(app, [*command, "--seed", seed, "--out", str(tmp_path / "runs")])
        assert result.exit_code == 2 and "--seed" in result.output, result.output
    assert not (tmp_path / "runs").exists()


def test_configs_refuse_a_seed_no_stream_takes():
    from crr.eval.evaluate import EvalConfig
    from crr.rollout import RolloutConfig
    from crr.sft.warm_start import SFTRecipe

    for make in (lambda s: EvalConfig("micro-test", "micro-test", model="m", seed=s), lambda s: RolloutConfig(seed=s),
                 lambda s: SFTRecipe(seed=s), lambda s: SFTRecipe(curriculum_seed=s)):
        for seed in (-1, 2 ** 32):
            with pytest.raises(CRRError, match=f"seed must be between 0 and 4294967295, got {seed}"):
                make(seed)


def test_a_string_bound_below_one_is_refused_as_it_is_parsed(tmp_path):
    # (crr rollout took --max-value-chars 0 as far as the grammar, once the model had loaded: about 10 s)
    for command, bad in ((["rollout", "--tasks", "micro-test", "--out", str(tmp_path / "runs")], "0"),
                         (["model", "generate", "--prompt", "hi"], "0"), (["model", "bench"], "0"),
                         (["rollout", "bench"], "-1")):   # rollout bench takes 0 as unbounded
        result = CliRunner().invoke(app, [*command, "--max-value-chars", bad])
        assert result.exit_code == 2 and "--max-value-chars" in result.output, (command, result.output)
    assert not (tmp_path / "runs").exists()


def test_filter_tasks_refuses_bad_workers_before_making_a_run_directory(task, tmp_path):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    result = CliRunner().invoke(app, ["filter-tasks", "--tasks", str(tasks), "--workers", "0",
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "greater than or equal to 1" in result.output, result.output
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


@pytest.mark.parametrize("option, value, message", [
    ("--group-size", "0", "must be at least 1"), ("--max-turns", "0", "must be at least 1"),
    ("--max-new-tokens", "0", "must be at least 1"), ("--model", "/no/such/model", "no such directory")])
def test_rollout_bench_refuses_bad_throughput_settings_before_the_fork_bench(monkeypatch, option, value, message):
    import crr.bench.rollout

    def fork_bench(*args, **kwargs):
        raise AssertionError("the fork bench ran before the settings were checked")

    monkeypatch.setattr(crr.bench.rollout, "fork_bench", fork_bench)
    result = CliRunner().invoke(app, ["rollout", "bench", option, value])
    assert result.exit_code == 2 and message in result.output, result.output


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


def _adapter(tmp_path):
    """A directory laid out as a saved LoRA adapter (no config.json)."""
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    return adapter


@pytest.mark.parametrize("kind", ["missing", "no-config", "adapter"])
def test_sft_refuses_untrainable_model_before_run_dir(tmp_path, kind):
    model = {"missing": tmp_path / "nope", "no-config": tmp_path, "adapter": _adapter(tmp_path)}[kind]
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["sft", "--model", str(model), "--n-tasks", "1", "--epochs", "1",
                                      "--out", str(runs)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.startswith("error:"), result.output
    assert not runs.exists() or not any(runs.iterdir())


def test_sft_bench_refuses_adapter(tmp_path):
    result = CliRunner().invoke(app, ["model", "sft-bench", "--model", str(_adapter(tmp_path)), "--steps", "1"])
    lines = result.output.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "LoRA adapter" in lines[0], result.output


@pytest.mark.parametrize("tasks", ["missing.jsonl", "bad.jsonl"])
def test_sft_refuses_bad_tasks_before_run_dir(tmp_path, tasks):
    (tmp_path / "bad.jsonl").write_text("not json\n")
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, ["sft", "--tasks", str(tmp_path / tasks), "--n-tasks", "1", "--out", str(runs)])
    assert result.exit_code == 2 and result.output.startswith("error:"), result.output
    assert not runs.exists() or not any(runs.iterdir())


def test_sft_data_only_shows_no_training_bar(tmp_path):
    """--data-only trains nothing: no 'SFT steps 0/?' bar beside the expert's."""
    from crr.tasks.micro import generate_micro

    generate_micro(tmp_path / "set", n=1, seed=0, split="train")
    result = CliRunner().invoke(app, ["sft", "--tasks", str(tmp_path / "set"), "--n-tasks", "1", "--data-only",
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    assert "expert data:" in result.output and "SFT steps" not in result.output, result.output


@pytest.mark.parametrize("value, message", [
    ("tasks=no-such-set", "'no-such-set' is not a file, a directory, a named set"),
    ("agent_format=bogus", "unknown agent format 'bogus'"),
    ("engine=bogus", "unknown fork engine 'bogus'"),
    ("model=/no/such/model", "model=/no/such/model: no such directory"),
])
def test_audit_refuses_bad_inputs_before_its_run_directory(tmp_path, monkeypatch, value, message):
    """Tasks, agent format, engine and model of a new audit are checked before its run directory is made
    (before: the directory was left behind, with the error only when the audit began)."""
    def played(*args, **kwargs):
        raise AssertionError("the audit was started")

    monkeypatch.setattr("crr.credit.audit.audit", played)
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["credit", "audit", value, "--out", str(out)])
    release_locks()
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not out.exists()


@pytest.mark.parametrize("value, message", [
    ("agent_format=bogus", "unknown agent format 'bogus'"),
    ("report_to=bogus", "report_to: unknown integration(s) ['bogus']; choose from none, "),
    ("report_to=[tensorboard,bogus]", "report_to: unknown integration(s) ['bogus']"),
])
def test_train_refuses_bad_inputs_before_its_run_directory(tmp_path, monkeypatch, value, message):
    """An unknown agent format or report_to integration is a one-line error before train's run directory is
    made (before: the directory was left behind, report_to's with a traceback once the trainer was built)."""
    def trained(*args, **kwargs):
        raise AssertionError("training was started")

    monkeypatch.setattr("crr.train.trainer.train", trained)
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["train", value, "--out", str(out)])
    release_locks()
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not out.exists()


def test_a_finished_run_is_not_trained_past_its_max_steps(tmp_path, monkeypatch):
    """`crr train --resume` of a finished run (its last checkpoint whole, at max_steps) is refused in one line,
    with nothing changed (before: TRL trained one update past max_steps and rewrote the run's summary)."""
    def trained(*args, **kwargs):
        raise AssertionError("training was started")

    monkeypatch.setattr("crr.train.trainer.train", trained)
    ref = Path(__file__).resolve().parents[1] / "results" / "reference" / "cpu-main" / "runs" / "crr"
    source = sorted(ref.glob("*-train-crr-seed11"))[0]
    run = tmp_path / "run"
    for f in subprocess.run(["git", "ls-files", "."], cwd=source, capture_output=True, text=True,
                            check=True).stdout.split():
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / f, run / f)
    last = run / "checkpoints" / "checkpoint-40"
    for name in ("optimizer.pt", "adapter_model.safetensors"):   # as if its weights were kept
        (last / name).write_bytes(b"")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for args in ([], ["--max-updates", "40"]):
        result = CliRunner().invoke(app, ["train", "--resume", str(run), *args])
        release_locks()
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert "finished its 40 updates (max_steps=40); to train on, resume it with --max-updates" in lines[0]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == before


@pytest.mark.parametrize("option, value", [("--workers", "0"), ("--n", "0"), ("--flaky-rate", "2"),
                                           ("--split", "foo")])
def test_filter_bench_refuses_bad_settings_before_its_run_directory(tmp_path, option, value):
    result = CliRunner().invoke(app, ["filter-tasks", "bench", option, value, "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [
    ["train", "model={model}"], ["credit", "audit", "model={model}"], ["sft", "--model", "{model}"],
    ["model", "sft-bench", "--model", "{model}", "--steps", "1"], ["eval", "micro", "--model", "{model}"]])
@pytest.mark.parametrize("kind, message", [
    ("file", "is a file; pass a model directory"), ("missing", ": no such directory; pass a model directory"),
    ("empty", ": that directory holds no model (config.json")])
def test_every_command_names_a_bad_model_path_alike(tmp_path, monkeypatch, command, kind, message):
    """One check (crr.policy.check_model) for every command that takes a model: a file, a missing path and a
    directory without a model are one line each, before any run directory (before: four checks with four
    messages; a file was told to `crr model init --out FILE`, which refuses a file)."""
    model = tmp_path / "m"
    if kind == "file":
        model.write_text("")
    elif kind == "empty":
        model.mkdir()
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, [*(a.format(model=model) for a in command), "--out", str(tmp_path / "runs")]
                                if command[:2] != ["model", "sft-bench"] else [a.format(model=model) for a in command])
    release_locks()
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", [["train", "model={model}"], ["sft", "--model", "{model}"]])
def test_training_refuses_a_lora_adapter_and_generation_takes_it(tmp_path, command):
    adapter = _adapter(tmp_path)
    result = CliRunner().invoke(app, [*(a.format(model=adapter) for a in command), "--out", str(tmp_path / "runs")])
    release_locks()
    assert result.exit_code == 2 and "is a LoRA adapter, and this command takes a whole model" in result.output
    from crr.policy import check_model

    check_model(str(adapter), f"--model {adapter}", adapter=True)   # eval and the credit audit merge it


@pytest.mark.parametrize(("args", "says", "help_of"), [
    (["eval", "--foo"], "error: No such option: --foo", "crr eval"),
    (["train", "--seed", "abc"], "error: Invalid value for '--seed'", "crr train"),
    (["nosuch"], "error: No such command 'nosuch'.", "crr"),
    (["credit"], "error: Missing command.", "crr credit"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, says, help_of):
    # Typer finds these before any crr code runs, and draws them as a box of 4-6 lines; `crr` (the console script
    # pyproject.toml installs) and `python -m crr` both print crr's one line instead, naming the help to read
    script = Path(sys.executable).with_name("crr")
    for proc in (crr_process(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                 subprocess.Popen([str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)):
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out, len(err.splitlines())) == (2, "", 1), err
        assert err.startswith(says) and err.endswith(f" (see {help_of} --help)\n"), err


def test_a_group_without_its_command_prints_its_help_and_no_error_line():
    proc = crr_process("model", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (2, "") and "Usage: crr model [OPTIONS] COMMAND" in out
