"""The environment demo end to end: a real micro task, real sandboxes, real forks, real pytest."""

import json

import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.demo import run_demo
from crr.sandbox import get_engine
from crr.rundir import RunDir
from crr.tasks.micro import generate_micro


@pytest.fixture(scope="module")
def micro_task(tmp_path_factory):
    return generate_micro(tmp_path_factory.mktemp("micro"), n=1, seed=3, split="train")[0]


def _check(result):
    assert result.reward == 1.0
    by_t = {f.t: f for f in result.forks}
    view_t, edit_t = sorted(by_t)
    assert result.steps[view_t].call["name"] == "view_file"
    assert result.steps[edit_t].call["name"] == "edit_file"
    # Reading another file first does not change the outcome; skipping the fix does.
    assert (by_t[view_t].r_counterfactual, by_t[view_t].advantage) == (1.0, 0.0)
    assert (by_t[edit_t].r_counterfactual, by_t[edit_t].advantage) == (0.0, 1.0)


def test_demo_forks_and_scores_contrasts_on_the_local_engine(micro_task, tmp_path):
    run = RunDir.create("demo", "test", root=tmp_path)
    engine = get_engine("local")
    try:
        _check(run_demo(micro_task, engine, run))
    finally:
        engine.close()
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["reward"] == 1.0 and sorted(summary["contrasts"].values()) == [0.0, 1.0]
    assert len(run.records("forks.jsonl")) == 2
    assert [s["call"]["name"] for s in run.records("trajectory.jsonl")][-1] == "submit_patch"


@pytest.mark.docker
@pytest.mark.parametrize("mode", ["commit", "overlay"])
def test_demo_on_the_docker_engine(micro_task, mode):
    engine = get_engine("docker", mode=mode)
    try:
        _check(run_demo(micro_task, engine))
    finally:
        engine.close()


def test_demo_command_writes_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "A_t" in result.output
    (run_dir,) = tmp_path.iterdir()
    assert {"config.yaml", "manifest.json", "summary.json", "forks.jsonl"} <= {p.name for p in run_dir.iterdir()}
