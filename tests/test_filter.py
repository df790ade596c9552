"""The three-rerun determinism filter on real tasks: real sandboxes, real pytest runs, real flakes.

Every flaky task here is built so that missing it has negligible probability, and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent_tasks import CALC, CALC_FIXED, TEST_CMD, TESTS, TESTS_WITH_ADD, file_diff
from crr.agent.verifier import seeded_order, swebench_spec
from crr.cli import app
from crr.filter.determinism import (ADMITTED, DISCARDED, F2P_PASSES_BEFORE_GOLD, INFRA_ERROR, NO_FAIL_TO_PASS,
                                    NONDETERMINISTIC, P2P_FAILS_BEFORE_GOLD, RESULTS, FilterConfig,
                                    discard_table, filter_tasks, open_run, run_seeds)
from crr.sandbox.checkout import cache_root
from crr.rundir import RunDir
from crr.tasks.loaders import load_tasks, write_tasks

WORDS = ("north", "south", "east", "west", "amber", "cobalt", "violet", "olive")
SET_LITERAL = "{" + ", ".join(json.dumps(w) for w in WORDS) + "}"
AUDIT_TESTS = ("_LOG = []\n\n\ndef test_log_starts_empty():\n    assert _LOG == []\n\n\n"
               "def test_log_records():\n    _LOG.append(1)\n    assert _LOG == [1]\n")
CONFIG = FilterConfig(reruns=3, timeout=120)


def calc(make_task, instance_id: str, extra_tests: dict[str, str] | None = None, gold: str = CALC_FIXED,
         f2p: tuple[str, ...] = ("tests/test_calc.py::test_add",), **fields):
    """The calc task (add() subtracts) with optional extra visible test files, all of them P2P."""
    extra_tests = extra_tests or {}
    files = {"calc.py": CALC, "tests/test_calc.py": TESTS, **extra_tests}
    p2p = ["tests/test_calc.py::test_mul"]
    for path, text in extra_tests.items():
        p2p += [f"{path}::{line[4:-3]}" for line in text.splitlines() if line.startswith("def test_")]
    fields = {"repo": "local/calc", "patch": file_diff("calc.py", CALC, gold), "FAIL_TO_PASS": f2p,
              "test_patch": file_diff("tests/test_calc.py", TESTS, TESTS_WITH_ADD),
              "PASS_TO_PASS": tuple(p2p), "test_cmd": TEST_CMD, **fields}
    return make_task(files, instance_id=instance_id, **fields)


def mislabelled(make_task, instance_id: str):
    """Its FAIL_TO_PASS test passes without the gold patch: discarded after the pre-check alone (a
    cheap task for the bookkeeping tests)."""
    return calc(make_task, instance_id, f2p=("tests/test_calc.py::test_mul",))


def hash_seed_task(make_task, instance_id: str = "hash-1"):
    # The test pins how an 8-string set iterates under PYTHONHASHSEED=0 (the local engine's default,
    # so the filter must set its own seeds to see it flake). Under another seed the order matches
    # with probability about 1/8!, so every run fails it: missing it has probability ~1e-5 per run.
    order = subprocess.run([sys.executable, "-c", f"print(', '.join({SET_LITERAL}))"], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"}).stdout.strip()
    test = f"def test_labels_in_order():\n    assert ', '.join({SET_LITERAL}) == {order!r}\n"
    return calc(make_task, instance_id, {"tests/test_labels.py": test})


def order_task(make_task, instance_id: str = "order-1"):
    # test_log_starts_empty fails iff test_log_records ran first. Reruns 1 and 2 run the ids in
    # mirror-image orders (run_seeds + seeded_order), so one of them fails it: detection is certain.
    return calc(make_task, instance_id, {"tests/test_audit.py": AUDIT_TESTS})


def random_gold_task(make_task, instance_id: str = "random-1"):
    # The gold patch itself is nondeterministic (unseeded random, fresh in every sandbox's process):
    # each of 10 FAIL_TO_PASS tests passes with probability 1/2 per run, so the pre-check passes and
    # three reruns agree on every test with probability (1/4)^10, about 1e-6.
    gold = CALC.replace("return a - b", "import random\n    return a + b if random.random() < 0.5 else a - b")
    tests = TESTS + "".join(f"\n\ndef test_add_{i}():\n    assert add({i}, 1) == {i + 1}\n"
                            for i in range(10))
    f2p = tuple(f"tests/test_calc.py::test_add_{i}" for i in range(10))
    return calc(make_task, instance_id, gold=gold, f2p=f2p,
                test_patch=file_diff("tests/test_calc.py", TESTS, tests))


def new_run(tmp_path: Path, tasks, config: FilterConfig = CONFIG, workers: int = 2):
    run = RunDir.create("filter-tasks", "test", root=tmp_path / "runs")
    return run, filter_tasks(tasks, run, config, workers=workers)


def by_id(run: RunDir) -> dict[str, dict]:
    return {r["instance_id"]: r for r in run.records(RESULTS)}


def table_rows(run: RunDir) -> list[list[str]]:
    """The discard table's rows, read from its markdown (the csv carries the same numbers)."""
    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.split("|")[1:-1]]

    header, _, *lines = (run.path / "discard_table.md").read_text().splitlines()
    assert cells(header) == ["repository", "tasks evaluated", "discarded", "discard rate (%)"]
    rows = [cells(line) for line in lines]
    csv = [line.split(",") for line in (run.path / "discard_table.csv").read_text().splitlines()[1:]]
    assert rows == csv
    return rows


def test_a_seeded_eval_script_sets_the_hash_seed_and_the_order(make_task):
    task = order_task(make_task)
    plain, seeded = swebench_spec(task).eval_script, swebench_spec(task, seed=7).eval_script
    assert seeded_order(task.held_out_tests, 7) != list(task.held_out_tests)
    assert "PYTHONHASHSEED" not in plain and " ".join(task.held_out_tests) in plain
    assert "export PYTHONHASHSEED=7\n" in seeded and " ".join(seeded_order(task.held_out_tests, 7)) in seeded
    assert seeded.replace("export PYTHONHASHSEED=7\n", "").replace(
        " ".join(seeded_order(task.held_out_tests, 7)), " ".join(task.held_out_tests)) == plain


def test_seeds_differ_and_pair_up_into_mirror_orders():
    seeds = run_seeds("t1", FilterConfig(reruns=4))
    assert len(set(seeds)) == 5 and 0 not in seeds and seeds[1] % 2 == 0
    assert seeds[1:] == list(range(seeds[1], seeds[1] + 4))
    ids = [f"t::{i}" for i in range(7)]
    assert seeded_order(ids, seeds[1]) == seeded_order(ids, seeds[2])[::-1]
    assert sorted(seeded_order(ids, seeds[3])) == sorted(ids)
    assert run_seeds("t1", FilterConfig(reruns=4)) == seeds != run_seeds("t2", FilterConfig(reruns=4))


def test_a_deterministic_task_is_admitted_and_ready_for_training(tmp_path, make_task):
    task = calc(make_task, "calc-1")
    run, summary = new_run(tmp_path, [task])
    record = by_id(run)["calc-1"]
    assert record["verdict"] == ADMITTED and record["reason"] is None and record["tests"] == {}
    assert (summary.evaluated, summary.admitted, summary.discarded, summary.infra_errors) == (1, 1, 0, 0)
    (admitted,) = load_tasks(str(run.path / "admitted.jsonl"))
    assert admitted == task and Path(admitted.repo_src).is_dir()
    assert (run.path / "discarded.jsonl").read_text() == ""
    assert table_rows(run) == [["local/calc", "1", "0", "0.0"], ["all", "1", "0", "0.0"]]


def test_planted_flakes_are_discarded(tmp_path, make_task):
    tasks = [hash_seed_task(make_task), order_task(make_task), random_gold_task(make_task),
             calc(make_task, "calc-1")]
    run, summary = new_run(tmp_path, tasks)
    records = by_id(run)
    assert records["hash-1"]["verdict"] == DISCARDED
    assert "tests/test_labels.py::test_labels_in_order" in records["hash-1"]["tests"]
    assert records["order-1"]["verdict"] == DISCARDED
    assert records["order-1"]["reason"] in (P2P_FAILS_BEFORE_GOLD, NONDETERMINISTIC)
    assert set(records["order-1"]["tests"]) == {"tests/test_audit.py::test_log_starts_empty"}
    rand = records["random-1"]
    assert rand["verdict"] == DISCARDED and rand["reason"] == NONDETERMINISTIC
    assert all(len(set(outcomes)) == 2 and len(outcomes) == 3 for outcomes in rand["tests"].values())
    assert records["calc-1"]["verdict"] == ADMITTED
    assert (summary.evaluated, summary.admitted, summary.discarded) == (4, 1, 3)
    discarded = [json.loads(line) for line in (run.path / "discarded.jsonl").read_text().splitlines()]
    assert [r["instance_id"] for r in discarded] == ["hash-1", "order-1", "random-1"]  # sorted, not by finish
    assert table_rows(run)[-1] == ["all", "4", "3", "75.0"]


def test_a_fail_to_pass_test_that_passes_without_gold_is_discarded(tmp_path, make_task):
    run, _ = new_run(tmp_path, [mislabelled(make_task, "mislabelled"), calc(make_task, "no-f2p", f2p=())])
    record = by_id(run)["mislabelled"]
    assert record["verdict"] == DISCARDED and record["reason"] == F2P_PASSES_BEFORE_GOLD
    assert record["tests"] == {"tests/test_calc.py::test_mul": ["PASSED"]}
    assert by_id(run)["no-f2p"]["reason"] == NO_FAIL_TO_PASS


def test_a_missing_bundle_is_an_infra_error_not_a_discard(tmp_path, make_task):
    broken = calc(make_task, "broken", repo_src=str(tmp_path / "gone.bundle"))
    run, summary = new_run(tmp_path, [broken, calc(make_task, "calc-1")])
    record = by_id(run)["broken"]
    assert record["verdict"] == INFRA_ERROR and "does not exist" in record["reason"]
    assert (summary.evaluated, summary.admitted, summary.discarded, summary.infra_errors) == (1, 1, 0, 1)
    assert summary.discard_rate == 0.0
    infra = (run.path / "infra_errors.jsonl").read_text().splitlines()
    assert [json.loads(line)["instance_id"] for line in infra] == ["broken"]
    assert "broken" not in (run.path / "discard_table.csv").read_text()


def test_resume_skips_decided_tasks_retries_infra_errors_and_rebuilds_outputs(tmp_path, make_task):
    tasks = [calc(make_task, "calc-1"), mislabelled(make_task, "mislabelled"),
             calc(make_task, "broken", repo_src=str(tmp_path / "gone.bundle"))]
    path = write_tasks(tasks, tmp_path / "tasks.jsonl")
    runner = CliRunner()
    first = runner.invoke(app, ["filter-tasks", "--tasks", str(path), "--out", str(tmp_path / "runs"),
                                "--timeout", "120"])
    assert first.exit_code == 0, first.output
    assert "evaluated 2, admitted 1, discarded 1 (discard rate 50.0%), infra errors 1" in first.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    before = RunDir.open(run_dir).records(RESULTS)
    for name in ("admitted.jsonl", "discarded.jsonl", "discard_table.md", "summary.json"):
        (run_dir / name).unlink()

    again = runner.invoke(app, ["filter-tasks", "--resume", str(run_dir)])
    assert again.exit_code == 0, again.output
    after = RunDir.open(run_dir).records(RESULTS)
    assert after[:3] == before and [r["instance_id"] for r in after[3:]] == ["broken"]  # only infra retried
    assert "1 admitted, 1 discarded, 1 infra" in again.output   # the bar counts what was decided before too
    assert [t.instance_id for t in load_tasks(str(run_dir / "admitted.jsonl"))] == ["calc-1"]
    assert json.loads((run_dir / "summary.json").read_text())["discarded"] == 1
    assert table_rows(RunDir(run_dir))[-1] == ["all", "2", "1", "50.0"]

    # --out naming the run directory resumes it too; a changed setting is refused, nothing is touched
    changed = runner.invoke(app, ["filter-tasks", "--out", str(run_dir), "--reruns", "5"])
    assert changed.exit_code == 2 and "reruns 3 -> 5" in changed.output
    assert RunDir.open(run_dir).records(RESULTS) == after

    # a task set whose decided task has changed since (here its FAIL_TO_PASS), or that lost one, is refused
    # before any sandbox starts; a changed statement or label is not what a verdict was decided on
    rows = path.read_text()
    write_tasks([replace(tasks[0], problem_statement="reworded", metadata={"flaky": True}), *tasks[1:]], path)
    assert runner.invoke(app, ["filter-tasks", "--resume", str(run_dir)]).exit_code == 0
    after = RunDir.open(run_dir).records(RESULTS)   # (its infra error retried once more)
    for edited in ([replace(tasks[0], FAIL_TO_PASS=tasks[0].FAIL_TO_PASS[:1] + ("tests/x.py::new",)), *tasks[1:]],
                   tasks[1:]):
        write_tasks(edited, path)
        refused = runner.invoke(app, ["filter-tasks", "--resume", str(run_dir)])
        assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
        assert "(e.g. calc-1); resume the run with the task set it was started with" in refused.output
        assert RunDir.open(run_dir).records(RESULTS) == after
    path.write_text(rows)


def test_a_torn_last_record_is_dropped_and_its_task_rerun(tmp_path, make_task):
    tasks = [mislabelled(make_task, "m-1"), mislabelled(make_task, "m-2")]
    run, _ = new_run(tmp_path, tasks[:1])
    with open(run.path / RESULTS, "a") as f:
        f.write('{"instance_id": "m-2", "verdict": "disc')  # the writer died mid-record
    summary = filter_tasks(tasks, run, CONFIG)
    lines = (run.path / RESULTS).read_text().splitlines()
    assert [json.loads(line)["instance_id"] for line in lines] == ["m-1", "m-2"]
    assert summary.discarded == 2 and summary.pending == 0


def test_an_interrupt_keeps_finished_tasks_and_closes_the_sandboxes_in_flight(tmp_path, make_task):
    tasks = [mislabelled(make_task, f"m-{i}") for i in range(3)]
    run = RunDir.create("filter-tasks", "test", root=tmp_path / "runs")

    def interrupt(record: dict) -> None:
        raise KeyboardInterrupt  # Ctrl-C right after the first task finished

    with pytest.raises(KeyboardInterrupt):
        filter_tasks(tasks, run, CONFIG, workers=1, on_result=interrupt)
    assert [r["instance_id"] for r in run.records(RESULTS)] == ["m-0"]
    sandboxes = cache_root() / "sandboxes"
    assert not list(sandboxes.glob(f"crr-engine-{os.getpid()}-*")), "an engine outlived the interrupt"
    with open("/proc/self/mounts") as f:
        assert not [line for line in f if str(sandboxes) in line], "a sandbox mount outlived the interrupt"
    summary = filter_tasks(tasks, run, CONFIG)
    assert summary.discarded == 3 and len(run.records(RESULTS)) == 3


def test_bad_settings_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(Exception, match="--reruns must be between 2"):
        open_run({"tasks": "x.jsonl", "reruns": 1}, tmp_path / "runs")
    with pytest.raises(Exception, match="'local' takes no option mode"):   # the engine checks its options
        open_run({"tasks": "x.jsonl", "mode": "commit"}, tmp_path / "runs")
    with pytest.raises(Exception, match="'docker' takes no option memory"):
        open_run({"tasks": "x.jsonl", "engine": "docker", "engine_options": {"memory": "4g"}}, tmp_path / "runs")
    with pytest.raises(Exception, match="does not exist"):
        open_run({"tasks": str(tmp_path / "missing.jsonl")}, tmp_path / "runs")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(Exception, match="empty.jsonl holds no tasks"):
        open_run({"tasks": str(tmp_path / "empty.jsonl")}, tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


def test_discard_table_per_repository():
    records = [{"repo": "a/x", "verdict": DISCARDED}, {"repo": "a/x", "verdict": ADMITTED},
               {"repo": "b/y", "verdict": ADMITTED}, {"repo": "b/y", "verdict": INFRA_ERROR},
               {"repo": "a/x", "verdict": ADMITTED}, {"repo": "a/x", "verdict": ADMITTED}]
    table = discard_table(records)
    assert table.values.tolist() == [["a/x", 4, 1, 25.0], ["b/y", 1, 0, 0.0], ["all", 5, 1, 20.0]]
    assert discard_table([{"repo": "c", "verdict": INFRA_ERROR}]).empty


def test_bench_scores_planted_flakes_against_their_labels(tmp_path):
    result = CliRunner().invoke(app, ["filter-tasks", "bench", "--n", "2", "--flaky-rate", "0.5",
                                      "--seed", "3", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    score = json.loads(result.stdout)
    assert score["flaky_tasks"] == 1 and score["deterministic_tasks"] == 1
    assert score["false_discards"] == 0 and score["infra_errors"] == 0
    assert sum(k["tasks"] for k in score["per_kind"].values()) == 1
    assert score["flaky_discarded"] == sum(k["discarded"] for k in score["per_kind"].values())
    assert score["tasks_per_min"] > 0
    run = RunDir.open(score["run_dir"])
    assert len(run.records(RESULTS)) == 2 and (run.path / "bench.json").is_file()
    assert all(Path(t.repo_src).is_file() for t in load_tasks(str(run.path / "admitted.jsonl")))


@pytest.mark.docker
def test_the_filter_on_the_docker_engine(tmp_path, make_task):
    tasks = [calc(make_task, "calc-1"), hash_seed_task(make_task),
             calc(make_task, "no-image", image="crr-test-missing-image:none")]
    run, summary = new_run(tmp_path, tasks, FilterConfig(engine="docker", engine_options={"mode": "commit"},
                                                         reruns=3, timeout=300))
    records = by_id(run)
    assert records["calc-1"]["verdict"] == ADMITTED
    assert records["hash-1"]["verdict"] == DISCARDED
    assert "tests/test_labels.py::test_labels_in_order" in records["hash-1"]["tests"]
    assert records["no-image"]["verdict"] == INFRA_ERROR and "is not present" in records["no-image"]["reason"]
    assert (summary.evaluated, summary.admitted, summary.discarded, summary.infra_errors) == (2, 1, 1, 1)
