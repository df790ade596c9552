"""What `crr report`, `crr view`, `crr experiment run --dry-run` and `crr eval` make of odd run directories: run
files edited into the wrong shape, runs of other commands or of two comparisons, a smoke evaluation beside the one a
spec asks for, a corrupt report index, a save cut short. Hand-made run directories, no model: seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from crr.cli import app
from crr.comparison import plan
from crr.errors import CRRError
from crr.eval import resolve_policy
from crr.experiments import EXPERIMENTS, load_comparison
from crr.report import _index
from crr.report.runs import load_runs
from crr.report.view import write_view


def make_run(path: Path, command: str, config=None, **files: str) -> Path:
    """A run directory of `command` holding config.yaml and `files` (name with "." as "_": text)."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"command": command}))
    (path / "config.yaml").write_text(yaml.safe_dump(config if config is not None else {"dataset": "nano-test2"}))
    for name, text in files.items():
        (path / name.replace("_", ".")).write_text(text)
    return path


RESULT = json.dumps({"instance_id": "t-0", "sample": 0, "reward": 1.0, "repo": "crr/nano"}) + "\n"


@pytest.mark.parametrize("name, text", [("config.yaml", "- a list\n"), ("summary.json", "[]\n")])
def test_report_names_a_run_file_that_is_not_a_mapping(tmp_path, name, text):
    run = make_run(tmp_path / "run", "eval", results_jsonl=RESULT, summary_json="{}")
    (run / name).write_text(text)
    with pytest.raises(CRRError, match=f"{name} is corrupt"):
        load_runs([tmp_path])


def test_report_names_a_corrupt_index_in_out(tmp_path):
    make_run(tmp_path / "runs" / "run", "eval", results_jsonl=RESULT)
    runs = load_runs([tmp_path / "runs"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.json").write_text("{torn")
    with pytest.raises(CRRError, match="report.json is corrupt"):
        _index(runs, tmp_path / "out", [])


def test_view_refuses_a_run_of_another_command(tmp_path):
    audit = make_run(tmp_path / "audit", "credit-audit", metrics_jsonl="", records_jsonl="")
    with pytest.raises(CRRError, match="credit-audit"):
        write_view([audit], tmp_path / "v.html")
    ev = make_run(tmp_path / "folder" / "eval", "eval", metrics_jsonl="", results_jsonl=RESULT,
                  transcripts_jsonl="")
    make_run(tmp_path / "folder" / "audit", "credit-audit", metrics_jsonl="")
    page = write_view([tmp_path / "folder"], tmp_path / "v.html").read_text()
    assert '"kind":"eval"' in page and '"kind":"train"' not in page and str(ev) in page


def test_view_shows_an_eval_without_its_transcripts_as_an_eval(tmp_path):
    ev = make_run(tmp_path / "eval", "eval", metrics_jsonl="", results_jsonl=RESULT)
    page = write_view([ev], tmp_path / "v.html").read_text()
    assert '"kind":"eval"' in page and '"kind":"train"' not in page and '"instance_id":"t-0"' in page


def test_view_names_a_summary_that_is_not_a_mapping(tmp_path):
    ev = make_run(tmp_path / "eval", "eval", results_jsonl=RESULT, transcripts_jsonl="", summary_json="[]")
    with pytest.raises(CRRError, match="summary.json is corrupt"):
        write_view([ev], tmp_path / "v.html")


def test_dry_run_with_an_unknown_seed_prints_only_the_error(tmp_path):
    spec = Path(__file__).resolve().parents[1] / "experiments" / "cpu-main.comparison.yaml"
    result = CliRunner().invoke(app, ["experiment", "run", str(spec), "--dry-run", "--seed", "99",
                                      "--out", str(tmp_path / "c")])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error:") and "arms ->" not in result.output, result.output


def test_report_index_lists_an_eval_whose_every_sample_met_an_infrastructure_failure(tmp_path):
    infra = json.dumps({"instance_id": "t-0", "sample": 0, "reward": None, "repo": "crr/nano"}) + "\n"
    make_run(tmp_path / "runs" / "run", "eval", results_jsonl=infra,
             summary_json=json.dumps({"pass_at_1": None, "missing": 0, "scored": 0}))
    _index(load_runs([tmp_path / "runs"]), tmp_path / "out", [])
    row = (tmp_path / "out" / "report.md").read_text().splitlines()[-1]
    assert [c.strip() for c in row.split("|")][-3:-1] == ["—", "run"], row


def test_report_refuses_a_spec_of_the_other_scale(tmp_path):
    make_run(tmp_path / "runs" / "grpo", "train", {"use_cpu": True, "method": "grpo", "seed": 11})
    paper = load_comparison(EXPERIMENTS / "paper-main.comparison.yaml")
    with pytest.raises(CRRError, match="paper-scale comparison.*cpu-scale train runs"):
        load_runs([tmp_path / "runs"], spec=paper)
    assert load_runs([tmp_path / "runs"], spec=load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")).train


def test_dry_run_of_a_spec_named_like_a_preset(tmp_path):
    """A spec file without the .comparison.yaml suffix and without evaluations: its name (and default --out) drops
    the .yaml, and no empty evaluation heading is printed."""
    spec = tmp_path / "mine.yaml"
    spec.write_text(f"arms:\n  a: {{config: {EXPERIMENTS / 'cpu-crr.yaml'}, seeds: [1]}}\n")
    assert load_comparison(spec).name == "mine"
    result = CliRunner().invoke(app, ["experiment", "run", str(spec), "--dry-run"])
    assert result.exit_code == 0 and "results/mine/runs/a" in result.output, result.output
    assert "then evaluated" not in result.output



def test_eval_of_a_hub_id_not_in_the_cache_fails_before_its_run_directory_exists():
    """resolve_policy, which open_eval calls before it makes the run directory, refuses it (offline: conftest)."""
    with pytest.raises(CRRError, match="cannot load a model from 'nosuch/hub-id'"):
        resolve_policy(model="nosuch/hub-id")


def test_dry_run_of_interrupted_runs_shows_their_resume_commands(tmp_path):
    """What run_comparison does with them (resume_eval / resume_run of those directories), not a fresh `crr eval`,
    quoted like every other command the dry run prints."""
    out, spec = tmp_path / "my comparison", load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")
    greedy = next(e for e in spec.evals if e.samples == 1)
    ev = make_run(out / "evals" / "base" / "20261129-072334-eval-nano-test2-default", "eval",
                  {"dataset": "nano-test2", "samples": 1, **greedy.settings}, summary_json=json.dumps({"missing": 5}))
    run = make_run(out / "runs" / "grpo" / "20261129-063804-train-grpo-seed11", "train",
                   {"use_cpu": True, "method": "grpo", "seed": 11})
    steps = plan(spec, out, [11], ["grpo"])
    assert [(s.status, s.command) for s in (steps[0], steps[2])] == [
        ("resume", f"crr eval --resume '{ev.resolve()}'"), ("resume", f"crr train --resume '{run.resolve()}'")]


def test_view_that_fails_mid_write_leaves_the_earlier_page_whole(tmp_path, monkeypatch):
    ev = make_run(tmp_path / "eval", "eval", results_jsonl=RESULT, transcripts_jsonl="")
    (tmp_path / "v.html").write_text("the earlier page")
    monkeypatch.setattr("crr.report.view.render", lambda runs: "<html>\ud800")   # cannot be encoded: fails mid-write
    with pytest.raises(UnicodeEncodeError):
        write_view([ev], tmp_path / "v.html")
    assert (tmp_path / "v.html").read_text() == "the earlier page"
    assert [p.name for p in tmp_path.iterdir() if p.name != "eval"] == ["v.html"]   # no temporary file left
    with pytest.raises(CRRError, match=f"--out {tmp_path} is a directory"):
        write_view([ev], tmp_path)


def test_report_index_gives_a_base_evaluation_no_seed_and_trained_ones_their_integer_seed(tmp_path):
    summary = json.dumps({"pass_at_1": 0.5, "missing": 0})
    make_run(tmp_path / "runs" / "base", "eval", summary_json=summary)
    make_run(tmp_path / "runs" / "trained", "eval", {"dataset": "nano-test2", "train_run": "gone", "train_seed": 11,
                                                     "method": "crr"}, summary_json=summary)
    _index(load_runs([tmp_path / "runs"]), tmp_path / "out", [])
    rows = [[c.strip() for c in line.split("|")[1:-1]]
            for line in (tmp_path / "out" / "report.md").read_text().splitlines()[-2:]]
    assert [(r[1], r[4]) for r in rows] == [("—", "—"), ("11", "—")], rows


def test_a_figure_whose_save_fails_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from crr.report.plots import _save

    (tmp_path / "f.png").write_bytes(b"the earlier figure")
    real = Figure.savefig

    def torn(fig, path, **kwargs):   # writes part of the file, then the process is interrupted
        Path(path).write_bytes(b"\x89PNG torn")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(KeyboardInterrupt):
        _save(Figure(), tmp_path, "f")
    assert (tmp_path / "f.png").read_bytes() == b"the earlier figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png"]   # no temporary file left
    monkeypatch.setattr(Figure, "savefig", real)
    assert [p.name for p in _save(Figure(), tmp_path, "f")] == ["f.png", "f.pdf"]
    assert (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG") and (tmp_path / "f.pdf").is_file()


def test_view_tells_a_greedy_and_a_sampled_evaluation_of_one_run_apart(tmp_path):
    """Their directories differ only in the timestamp: crr eval --run RUN, then --samples 2 of the same RUN."""
    two = RESULT + json.dumps({"instance_id": "t-0", "sample": 1, "reward": 0.0, "repo": "crr/nano"}) + "\n"
    greedy = make_run(tmp_path / "20261129-065824-eval-nano-test2-20261129-065054-train-crr-seed11", "eval",
                      results_jsonl=RESULT, summary_json=json.dumps({"dataset": "nano-test2"}))
    sampled = make_run(tmp_path / "20261129-070052-eval-nano-test2-20261129-065054-train-crr-seed11", "eval",
                       results_jsonl=two, summary_json=json.dumps({"dataset": "nano-test2"}))
    page = write_view([greedy, sampled], tmp_path / "v.html").read_text()
    assert re.findall(r'"kind":"eval","label":"([^"]*)"', page) == ["crr-seed11", "crr-seed11 x2"]


def test_a_later_smoke_evaluation_does_not_stand_in_for_the_one_the_spec_asks_for(tmp_path):
    """A base-policy eval of 2 tasks made after the spec's 256-task one (both in --runs): the tables keep the 256."""
    from crr.report.tables import Needs, base_evals

    spec = load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")
    greedy = next(e for e in spec.evals if e.samples == 1)
    summary = json.dumps({"pass_at_1": 0.3, "missing": 0})
    for name, n_tasks in (("20261129-072334-eval-nano-test2-default", 256),
                          ("20261130-125902-eval-nano-test2-default", 2)):
        make_run(tmp_path / name, "eval", {"dataset": "nano-test2", "model": "crr/policy/default", "samples": 1,
                                           **greedy.settings, "n_tasks": n_tasks}, summary_json=summary)
    train = make_run(tmp_path / "20261129-063804-train-grpo-seed11", "train", {"use_cpu": True, "method": "grpo",
                                                                              "seed": 11})
    for name, n_tasks in (("20261129-064350-eval-nano-test2-train-grpo-seed11", 256),
                          ("20261130-125903-eval-nano-test2-train-grpo-seed11", 2)):
        make_run(tmp_path / name, "eval", {"dataset": "nano-test2", "train_run": str(train), "samples": 1,
                                           **greedy.settings, "n_tasks": n_tasks}, summary_json=summary)
    runs = load_runs([tmp_path], spec=spec)
    assert [e.config["n_tasks"] for e in base_evals(runs, Needs(runs, spec), greedy).values()] == [256]
    assert Needs(runs, spec).eval(runs.train[0], greedy).config["n_tasks"] == 256


def test_a_comparison_does_not_take_a_smoke_evaluation_for_the_one_its_spec_asks_for(tmp_path):
    """A complete 2-task base-policy eval in OUT/evals/base: the spec's 256-task one is still to do, not done."""
    spec = load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")
    greedy = next(e for e in spec.evals if e.samples == 1)
    make_run(tmp_path / "evals" / "base" / "20261130-125902-eval-nano-test2-default", "eval",
             {"dataset": "nano-test2", "samples": 1, **greedy.settings, "n_tasks": 2},
             summary_json=json.dumps({"pass_at_1": 0.0, "missing": 0}))
    assert plan(spec, tmp_path, [11], ["grpo"])[0].status == "todo"


def test_report_refuses_one_arm_and_seed_trained_on_two_task_sets(tmp_path):
    """--runs holding two comparisons (cpu-main's nano runs and multi-main's): seed 11 of GRPO twice, on different
    tasks, of which the tables would silently keep one; a rerun of a seed on the same tasks is fine (the latest)."""
    config = {"use_cpu": True, "method": "grpo", "seed": 11}
    make_run(tmp_path / "a" / "20261129-063804-train-grpo-seed11", "train", {**config, "tasks": "nano-band"})
    make_run(tmp_path / "a" / "20261130-063804-train-grpo-seed11", "train", {**config, "tasks": "nano-band"})
    assert len(load_runs([tmp_path / "a"]).train) == 2
    make_run(tmp_path / "b" / "20261128-230316-train-grpo-seed11", "train", {**config, "tasks": "multi-band"})
    with pytest.raises(CRRError, match="seed 11 of one arm .grpo. trained on different tasks or models"):
        load_runs([tmp_path])


def test_report_names_a_corrupt_manifest_of_any_run_under_runs(tmp_path):
    run = tmp_path / "runs" / "20261130-000000-eval-x"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{garb")
    result = CliRunner().invoke(app, ["report", "tables", "--runs", str(tmp_path / "runs"),
                                      "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "manifest.json is corrupt" in result.output, result.output


def test_a_pair_without_enough_per_task_records_names_the_run_short_of_them(tmp_path):
    from crr.report.tables import paired_table

    spec = load_comparison(EXPERIMENTS / "cpu-main.comparison.yaml")
    greedy = next(e for e in spec.evals if e.samples == 1)
    summary = json.dumps({"pass_at_1": 0.5, "missing": 0})
    records = "".join(json.dumps({"instance_id": f"t-{i}", "sample": 0, "reward": float(i % 2), "repo": "crr/nano"})
                      + "\n" for i in range(3))
    make_run(tmp_path / "20261129-072334-eval-nano-test2-default", "eval",
             {"dataset": "nano-test2", "model": "crr/policy/default", "samples": 1, **greedy.settings},
             summary_json=summary, results_jsonl=RESULT)
    train = make_run(tmp_path / "20261129-063804-train-grpo-seed11", "train",
                     {"use_cpu": True, "method": "grpo", "seed": 11}, summary_json="{}")
    make_run(tmp_path / "20261129-064350-eval-nano-test2-train-grpo-seed11", "eval",
             {"dataset": "nano-test2", "train_run": str(train), "samples": 1, **greedy.settings},
             summary_json=summary, results_jsonl=records)
    notes = paired_table(load_runs([tmp_path], spec=spec)).notes
    assert any("fewer than two tasks" in n and "20261129-072334-eval-nano-test2-default holds fewer than two" in n
               for n in notes), notes
