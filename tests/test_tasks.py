"""Task loading: JSONL validation with FILE:LINE errors, the dataset adapters on local fixture
datasets (save_to_disk and parquet, never the hub), and `crr tasks show`."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.errors import CRRError, TaskFormatError
from crr.tasks import loaders
from crr.tasks.loaders import load_tasks, read_tasks_jsonl, write_tasks


def row(instance_id: str = "org__proj-1", **overrides) -> dict:
    base = {"instance_id": instance_id, "repo": "org/proj", "base_commit": "a" * 40,
            "problem_statement": "it breaks", "patch": "diff --git a/x b/x\n", "test_patch": "",
            "FAIL_TO_PASS": ["tests/test_x.py::test_a"], "PASS_TO_PASS": [], "version": "1.0"}
    return {**base, **overrides}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ------------------------------------------------------------------------------------ JSONL

def test_fail_to_pass_as_json_text_or_list_loads_the_same(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [
        row("a", FAIL_TO_PASS=json.dumps(["t::x", "t::y"]), PASS_TO_PASS="[]"),
        "",  # blank lines are allowed
        row("b", FAIL_TO_PASS=["t::x", "t::y"]),
    ])
    a, b = load_tasks(str(f))
    assert a.FAIL_TO_PASS == b.FAIL_TO_PASS == ("t::x", "t::y")
    assert a.PASS_TO_PASS == ()


@pytest.mark.parametrize("bad, field", [
    ('{"instance_id": "x", ', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({k: v for k, v in row().items() if k != "base_commit"}), "'base_commit'"),
    (json.dumps(row(FAIL_TO_PASS=3)), "'FAIL_TO_PASS'"),
    (json.dumps(row(FAIL_TO_PASS="not json")), "'FAIL_TO_PASS'"),
    (json.dumps(row(version=1.0)), "'version'"),
    (json.dumps(row(log_parser="parse_log_nonsense")), "'log_parser'"),
    (json.dumps(row(metadata=[1])), "'metadata'"),
    (json.dumps(row(colour="blue")), "unknown field(s) ['colour']"),
])
def test_a_malformed_line_names_file_line_and_field(tmp_path, bad, field):
    f = write_jsonl(tmp_path / "t.jsonl", [row("ok-1"), "", bad, row("ok-2")])
    with pytest.raises(TaskFormatError) as e:
        load_tasks(str(f))
    assert str(e.value).startswith(f"{f}:3: ")
    assert field in str(e.value)


def test_a_duplicate_instance_id_is_an_error(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [row("x"), row("y"), row("x")])
    with pytest.raises(TaskFormatError, match=r"t.jsonl:3: duplicate instance_id 'x' \(first on line 1\)"):
        load_tasks(str(f))


def test_relative_repo_src_resolves_against_the_file_and_is_written_relative(tmp_path):
    (tmp_path / "sets" / "repos").mkdir(parents=True)
    f = write_jsonl(tmp_path / "sets" / "tasks.jsonl", [row("x", repo_src="repos/x.bundle")])
    (task,) = load_tasks(str(tmp_path / "sets"))  # a directory holding tasks.jsonl
    assert task.repo_src == str((tmp_path / "sets" / "repos" / "x.bundle").resolve())

    out = write_tasks([task], tmp_path / "sets" / "copy.jsonl")
    assert json.loads(out.read_text())["repo_src"] == "repos/x.bundle"
    assert read_tasks_jsonl(out) == [task]
    assert f.read_text() != ""  # the source file is untouched


def test_write_tasks_round_trips_metadata_and_extra_fields(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [row("x", hints_text="try y", metadata={"difficulty": "hard"})])
    (task,) = load_tasks(str(f))
    (again,) = read_tasks_jsonl(write_tasks([task], tmp_path / "out.jsonl"))
    assert again == task and again.metadata == {"difficulty": "hard"} and again.extra == {"hints_text": "try y"}


def test_paths_and_names_that_are_not_task_sets_get_clear_errors(tmp_path):
    with pytest.raises(CRRError, match="does not exist"):
        load_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(CRRError, match="neither tasks.jsonl"):
        load_tasks(str(tmp_path))
    with pytest.raises(CRRError, match="not a file, a directory"):
        load_tasks("no such thing")
    f = write_jsonl(tmp_path / "t.jsonl", [row()])
    with pytest.raises(CRRError, match="--split applies to datasets"):
        load_tasks(str(f), split="test")


def test_a_new_named_set_is_one_registration_served_by_load_tasks_crr_eval_and_crr_tasks_sets(tmp_path):
    from crr.eval.evaluate import benchmark

    f = write_jsonl(tmp_path / "t.jsonl", [row()])
    loaders.register_task_set("toy-set", "a one-row toy", lambda split: read_tasks_jsonl(f))
    try:
        assert [t.instance_id for t in load_tasks("toy-set")] == [row()["instance_id"]]
        assert benchmark("toy-set") == ("toy-set", "toy-set", None)
        with pytest.raises(CRRError, match="takes no FILE"):
            benchmark("toy-set", str(f))
        listed = CliRunner().invoke(app, ["tasks", "sets", "--json"])
        assert (listed.exit_code == 0
                and {"name": "toy-set", "what": "a one-row toy", "dataset": None} in json.loads(listed.output))
    finally:
        del loaders.TASK_SETS["toy-set"]
    # the hub's benchmarks: crr eval reads the dataset (or a local copy of it) through the dataset's adapter
    assert benchmark("verified") == ("verified", "SWE-bench/SWE-bench_Verified", "swe-bench")
    assert benchmark("gym", "copy/") == ("gym", "copy/", "swe-gym")
    with pytest.raises(CRRError, match="unknown benchmark 'toy-set'; use one of micro, micro-train"):
        benchmark("toy-set")


# ------------------------------------------------------------------------------------ datasets

VERIFIED_ROWS = [  # princeton-nlp/SWE-bench_Verified: 12 string columns, F2P/P2P as JSON text
    {"repo": "django/django", "instance_id": "django__django-11099", "base_commit": "d" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "validators allow trailing newline",
     "hints_text": "", "created_at": "2019-03-20T03:46:18Z", "version": "3.0",
     "FAIL_TO_PASS": '["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"]',
     "PASS_TO_PASS": '["test_help_text (auth_tests.test_validators.UserAttributeSimilarityValidatorTest)"]',
     "environment_setup_commit": "e" * 40, "difficulty": "<15 min fix"},
    {"repo": "astropy/astropy", "instance_id": "astropy__astropy-12907", "base_commit": "a" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "separability matrix", "hints_text": "",
     "created_at": "2022-03-03T15:14:54Z", "version": "4.3",
     "FAIL_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]',
     "PASS_TO_PASS": "[]", "environment_setup_commit": "b" * 40, "difficulty": "15 min - 1 hour"},
]
V5_ROWS = [  # SWE-bench/SWE-bench_Verified (swebench 5.x): carries image, eval_script, log_parser
    {**VERIFIED_ROWS[1], "image": "registry.example/astropy-12907:v5", "eval_script": "#!/bin/bash\npytest -rA",
     "log_parser": "parse_log_pytest_v2", "eval_type": "pass_and_fail"},
]
GYM_ROWS = [  # SWE-Gym/SWE-Gym: lists, no environment_setup_commit
    {"instance_id": "Project-MONAI__MONAI-1121", "repo": "Project-MONAI/MONAI", "base_commit": "c" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "x", "hints_text": "",
     "created_at": "2020-10-14T10:11:12Z", "version": "0.3",
     "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": ["tests/test_a.py::test_y"]},
    {"instance_id": "getmoto__moto-5752", "repo": "getmoto/moto", "base_commit": "f" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "y", "hints_text": "",
     "created_at": "2022-12-08T21:03:04Z", "version": "4.0",
     "FAIL_TO_PASS": ["tests/test_ssm.py::test_get"], "PASS_TO_PASS": []},
]
REBENCH_ROWS = [  # nebius/SWE-rebench: docker_image, install_config with test_cmd and log_parser
    {"instance_id": "sqlfluff__sqlfluff-5362", "repo": "sqlfluff/sqlfluff", "base_commit": "1" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "z", "hints_text": "", "created_at": "2023-11-01",
     "version": "2.3", "environment_setup_commit": "1" * 40,
     "FAIL_TO_PASS": ["test/a.py::t1"], "PASS_TO_PASS": ["test/a.py::t2"], "FAIL_TO_FAIL": [], "PASS_TO_FAIL": [],
     "docker_image": "swerebench/sweb.eval.x86_64.sqlfluff_1776_sqlfluff-5362",
     "install_config": {"python": "3.9", "install": "pip install -e .", "log_parser": "parse_log_pytest",
                        "test_cmd": "pytest --no-header -rA --tb=no -p no:cacheprovider"},
     "meta": {"llm_score": {"difficulty_score": 1}, "is_lite": False}, "license_name": "MIT"},
    {"instance_id": "pylint-dev__astroid-2000", "repo": "pylint-dev/astroid", "base_commit": "2" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "w", "hints_text": "", "created_at": "2023-01-01",
     "version": "2.14", "environment_setup_commit": "2" * 40,
     "FAIL_TO_PASS": ["tests/t.py::a"], "PASS_TO_PASS": [], "FAIL_TO_FAIL": [], "PASS_TO_FAIL": [],
     "docker_image": "swerebench/sweb.eval.x86_64.pylint-dev_1776_astroid-2000",
     "install_config": {"python": "3.10", "install": "pip install -e .", "log_parser": "parse_log_pytest_v2",
                        "test_cmd": "pytest -rA"},
     "meta": {"llm_score": {"difficulty_score": 2}, "is_lite": True}, "license_name": "LGPL"},
]
LIVE_ROWS = [  # SWE-bench-Live: test_cmds list, short parser names, docker_image optional, no version
    {"instance_id": "pydantic__pydantic-11000", "repo": "pydantic/pydantic", "base_commit": "3" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "v", "hints_text": "", "created_at": "2025-01-02",
     "FAIL_TO_PASS": ["tests/t.py::a"], "PASS_TO_PASS": ["tests/t.py::b"],
     "test_cmds": ["pytest -rA tests/t.py"], "log_parser": "pytest", "docker_image": None},
    {"instance_id": "Textualize__rich-3500", "repo": "Textualize/rich", "base_commit": "4" * 40,
     "patch": "diff", "test_patch": "diff", "problem_statement": "u", "hints_text": "", "created_at": "2025-02-03",
     "FAIL_TO_PASS": ["tests/t.py::c"], "PASS_TO_PASS": [],
     "test_cmds": ["pip install -e .", "pytest -rA"], "log_parser": "pytest",
     "docker_image": "starryzhang/sweb.eval.x86_64.textualize_1776_rich-3500:custom"},
]


def save(rows: list[dict], path: Path, as_parquet: bool = False) -> Path:
    ds = datasets.Dataset.from_list(rows)
    if as_parquet:
        ds.to_parquet(str(path))
    else:
        ds.save_to_disk(str(path))
    return path


def test_swebench_verified_rows_get_the_image_parser_and_runner_of_their_repo(tmp_path):
    django, astropy = load_tasks(str(save(VERIFIED_ROWS, tmp_path / "verified")), adapter="swe-bench")
    assert django.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert django.log_parser == "parse_log_django"
    assert django.test_cmd.startswith("./tests/runtests.py")
    assert django.FAIL_TO_PASS == ("test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",)
    assert django.extra["difficulty"] == "<15 min fix"
    assert astropy.log_parser == "parse_log_pytest_v2" and astropy.test_cmd.startswith("pytest -rA")


def test_swebench_v5_rows_keep_their_own_image_and_eval_script(tmp_path):
    (task,) = load_tasks(str(save(V5_ROWS, tmp_path / "v5.parquet", as_parquet=True)),
                         adapter="SWE-bench/SWE-bench_Verified")  # a dataset name selects its adapter
    assert task.image == "registry.example/astropy-12907:v5"
    assert task.eval_script.endswith("pytest -rA") and task.log_parser == "parse_log_pytest_v2"
    assert task.extra["eval_type"] == "pass_and_fail"


def test_swe_gym_rows_get_the_openhands_image_name(tmp_path):
    monai, moto = load_tasks(str(save(GYM_ROWS, tmp_path / "gym")), adapter="swe-gym")
    assert monai.image == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-1121:latest"
    assert moto.image == "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest"
    assert monai.PASS_TO_PASS == ("tests/test_a.py::test_y",) and monai.log_parser == "parse_log_pytest"


def test_swe_rebench_rows_take_image_runner_and_parser_from_the_row(tmp_path):
    sqlfluff, astroid = load_tasks(str(save(REBENCH_ROWS, tmp_path / "rebench.parquet", as_parquet=True)),
                                   adapter="swe-rebench")
    assert sqlfluff.image == "swerebench/sweb.eval.x86_64.sqlfluff_1776_sqlfluff-5362"
    assert sqlfluff.test_cmd == "pytest --no-header -rA --tb=no -p no:cacheprovider"
    assert astroid.log_parser == "parse_log_pytest_v2"
    assert astroid.extra["meta"]["is_lite"] is True and astroid.extra["install_config"]["python"] == "3.10"


def test_swe_bench_live_rows_default_the_image_and_join_test_commands(tmp_path):
    pydantic, rich_ = load_tasks(str(save(LIVE_ROWS, tmp_path / "live")), adapter="swe-bench-live")
    assert pydantic.image == "starryzhang/sweb.eval.x86_64.pydantic_1776_pydantic-11000:latest"
    assert rich_.image == "starryzhang/sweb.eval.x86_64.textualize_1776_rich-3500:custom"
    assert pydantic.log_parser == "parse_log_pytest" and pydantic.version == "none"
    assert rich_.test_cmd == "pip install -e . && pytest -rA"


def test_the_generic_adapter_keeps_unknown_columns_in_metadata(tmp_path):
    rows = [{**GYM_ROWS[0], "image_name": "my/image:1", "stars": 12}]
    (task,) = load_tasks(str(save(rows, tmp_path / "any")))
    assert task.image == "my/image:1" and task.metadata == {"stars": 12}


def test_a_bad_dataset_row_names_the_row_and_the_field(tmp_path):
    rows = [GYM_ROWS[0], {**GYM_ROWS[1], "version": None}]  # a null cell
    with pytest.raises(TaskFormatError,
                       match=r"\[train\] row 1 \(getmoto__moto-5752\): missing required field 'version'"):
        load_tasks(str(save(rows, tmp_path / "gym")), adapter="swe-gym")
    with pytest.raises(CRRError, match="unknown adapter"):
        load_tasks(str(tmp_path / "gym"), adapter="nope")


def test_a_dataset_dict_with_several_splits_needs_split(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GYM_ROWS[:1]),
                          "test": datasets.Dataset.from_list(GYM_ROWS[1:])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CRRError, match="choose one with --split"):
        load_tasks(str(tmp_path / "dd"), adapter="swe-gym")
    (task,) = load_tasks(str(tmp_path / "dd"), split="test", adapter="swe-gym")
    assert task.instance_id == "getmoto__moto-5752"


def test_hub_names_go_through_load_dataset_with_their_adapter_and_default_split(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list(REBENCH_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tasks = load_tasks("nebius/SWE-rebench")
    assert calls == [("nebius/SWE-rebench", "test")]
    assert tasks[0].image == "swerebench/sweb.eval.x86_64.sqlfluff_1776_sqlfluff-5362"


def test_an_unreachable_hub_says_how_to_pass_a_local_copy():
    with pytest.raises(CRRError) as e:  # the test session runs with HF_HUB_OFFLINE=1
        load_tasks("SWE-Gym/SWE-Gym")
    assert "could not reach the Hugging Face hub" in str(e.value)
    assert "save_to_disk" in str(e.value) and "--adapter swe-gym --out tasks.jsonl" in str(e.value)


# ------------------------------------------------------------------------------------ CLI

def test_show_lists_a_dataset_copy_and_exits_2_on_a_bad_file(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["tasks", "show", str(save(REBENCH_ROWS, tmp_path / "rb")), "--adapter",
                                 "swe-rebench"])
    assert result.exit_code == 0, result.output
    assert "sqlfluff__sqlfluff-5362" in result.output and "2 tasks" in result.output

    result = runner.invoke(app, ["tasks", "show", str(tmp_path / "rb"), "--adapter", "swe-rebench", "--json",
                                 "--limit", "1"])
    assert [r["instance_id"] for r in json.loads(result.stdout)] == ["sqlfluff__sqlfluff-5362"]

    # --out: the copy as a task file, which every --tasks option reads without an adapter
    result = runner.invoke(app, ["tasks", "show", str(tmp_path / "rb"), "--adapter", "swe-rebench",
                                 "--out", str(tmp_path / "rb.jsonl")])
    assert result.exit_code == 0 and "wrote 2 tasks" in result.output, result.output
    assert load_tasks(str(tmp_path / "rb.jsonl")) == load_tasks(str(tmp_path / "rb"), adapter="swe-rebench")
    result = runner.invoke(app, ["tasks", "show", str(tmp_path / "rb"), "--out", str(tmp_path / "rb.jsonl")])
    assert result.exit_code == 2 and "already exists" in result.output

    bad = write_jsonl(tmp_path / "bad.jsonl", [row("a"), row("b", FAIL_TO_PASS=7)])
    result = runner.invoke(app, ["tasks", "show", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2:" in result.output and "FAIL_TO_PASS" in result.output


def test_micro_names_generate_once_into_the_cache(monkeypatch):
    monkeypatch.setattr(loaders, "MICRO_DEFAULT_N", {"default": 1, "nano": 1})
    (task,) = load_tasks("micro-test")
    assert task.instance_id == "micro-test-0-0" and Path(task.repo_src).is_file()
    assert "micro" in Path(task.repo_src).parts

    import crr.tasks.micro

    monkeypatch.setattr(crr.tasks.micro, "generate_micro", lambda *a, **k: pytest.fail("regenerated"))
    assert load_tasks("micro-test") == [task]
    with pytest.raises(CRRError, match="drop --split"):
        load_tasks("micro-test", split="train")
