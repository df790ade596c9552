"""`crr tasks synth` on real PyPI packages (sdist -> git repo -> its own test suite in a sandbox ->
SWE-smith's procedural bugs -> measured rows), and the committed task set built from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crr.agent.verifier import verify
from crr.cli import app
from crr.errors import CRRError
from crr.filter.determinism import ADMITTED, RESULTS, FilterConfig, filter_tasks
from crr.sandbox import get_engine
from crr.rundir import RunDir
from crr.tasks.loaders import TASKS_FILE, load_tasks
from crr.tasks.schema import DEFAULT_TEST_CMD
from crr.tasks.sdist import declared_requirements, find, import_roots
from crr.tasks.synth import PYTEST, PYTEST_COV, _pytest_setup, curated, materialise, parse_package, synthesise

SYNTH_V1 = Path(__file__).resolve().parents[1] / "data" / "tasks" / "synth-v1.jsonl"
INFLECTION = parse_package("inflection==0.5.1")  # one module, 455 tests in half a second
INFLECTION_SHA256 = "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417"  # as PyPI publishes it


@pytest.fixture(scope="module")
def synthesised(tmp_path_factory) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp("synth") / "inflection"
    return out, synthesise([INFLECTION], out, n=1, seed=0, max_candidates=4)


def test_synth_makes_rows_whose_fail_to_pass_fail_before_and_pass_after_the_gold_patch(synthesised):
    _, (task,) = synthesised
    assert task.repo == "pypi/inflection" and task.repo_src is None and task.version == "0.5.1"
    assert task.sdist["sha256"] == INFLECTION_SHA256 and task.sdist["filename"] == "inflection-0.5.1.tar.gz"
    assert any(line.startswith(PYTEST + " --hash=sha256:") for line in task.mirror["requirements"])
    assert (task.metadata["bug_strategy"].startswith("func_pm_")
            and task.metadata["buggy_file"] == "inflection/__init__.py")
    assert "+++ b/inflection/__init__.py" in task.patch and "new file mode" in task.test_patch
    assert task.FAIL_TO_PASS and task.PASS_TO_PASS and not set(task.FAIL_TO_PASS) & set(task.PASS_TO_PASS)
    assert any(f"`{t}`" in task.problem_statement for t in task.FAIL_TO_PASS)  # written from a failing test
    with get_engine("local") as engine:
        with engine.start(task) as sb:  # base_commit: the bug, the failing tests' file hidden
            assert sb.exec("test ! -e test_inflection.py", timeout=10).exit_code == 0
            before = verify(sb, task, timeout=300)
        with engine.start(task) as sb:
            sb.write_file(".git/crr/gold.patch", task.patch.encode())
            assert sb.exec("git apply .git/crr/gold.patch", timeout=60).exit_code == 0
            after = verify(sb, task, timeout=300)
    assert before.reward == 0.0 and after.reward == 1.0, (before.note, after.note)
    assert all(before.statuses[t] != "PASSED" for t in task.FAIL_TO_PASS)
    assert all(before.statuses[t] == "PASSED" for t in task.PASS_TO_PASS)


def test_an_interrupted_synth_resumes_and_other_settings_are_refused(synthesised):
    out, tasks = synthesised
    (out / TASKS_FILE).unlink()  # interrupted after its package finished
    calls = []
    assert synthesise([INFLECTION], out, n=1, seed=0, max_candidates=4, progress=calls.append) == tasks
    assert calls == [] and load_tasks(str(out)) == tasks  # nothing ran again
    with pytest.raises(CRRError, match="other settings"):
        synthesise([INFLECTION], out, n=2, seed=0, max_candidates=4)


def test_a_row_rebuilds_its_repository_from_the_sdist_or_is_refused(synthesised):
    _, (task,) = synthesised
    assert (materialise(task) / ".git").is_dir()
    with pytest.raises(CRRError, match="does not match its sdist"):
        materialise(dataclasses.replace(task, base_commit="0" * 40))
    with pytest.raises(CRRError, match="not the 0000"):
        materialise(dataclasses.replace(task, base_commit="1" * 40, sdist={**task.sdist, "sha256": "0" * 64}))


def test_the_committed_task_set_loads_and_its_tasks_pass_the_filter(tmp_path):
    tasks = load_tasks(str(SYNTH_V1))
    assert len(tasks) >= 10 and all(t.sdist and t.mirror and t.repo_src is None for t in tasks)
    packages = {t.repo for t in tasks}
    assert len(packages) >= 5 and packages <= {f"pypi/{p.name}" for p in curated()}
    smallest = min(tasks, key=lambda t: len(t.held_out_tests))
    run = RunDir.create("filter-tasks", "synth-v1", root=tmp_path / "runs")
    summary = filter_tasks([smallest], run, FilterConfig(reruns=3, timeout=300), workers=1)
    (record,) = run.records(RESULTS)
    assert record["verdict"] == ADMITTED, record
    assert summary.admitted == 1 and load_tasks(str(run.path / "admitted.jsonl")) == [smallest]


def test_bad_packages_are_clear_errors(tmp_path):
    with pytest.raises(CRRError, match="is not a project"):
        find("crr-no-such-package-anywhere", "1.0")
    with pytest.raises(CRRError, match="no release 99.0"):
        find("inflection", "99.0")
    with pytest.raises(CRRError, match="no source distribution"):
        find("tree-sitter-php", "0.23.0")  # published as wheels only
    runner = CliRunner()
    result = runner.invoke(app, ["tasks", "synth", "--package", "sortedcontainers==2.4.0", "--out",
                                 str(tmp_path / "s")])
    assert result.exit_code == 2 and "carries no tests" in result.output
    result = runner.invoke(app, ["tasks", "synth", "--package", "inflection", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "NAME==VERSION" in result.output and not (tmp_path / "x").exists()
    result = runner.invoke(app, ["tasks", "synth", "--package", "inflection==0.5.1", "--out", str(tmp_path / "s"),
                                 "--n", "0"])
    assert result.exit_code == 2 and "--n must be at least 1" in result.output


@pytest.mark.parametrize("package, why", [
    ("humanize==4.9.0", "a src/ layout whose package reads its own version from its installed metadata"),
    ("isodate==0.6.1", "an older sdist whose PKG-INFO has no Requires-Dist: its runtime dependency six is in setup.py"),
])
def test_packages_shaped_unlike_the_curated_ones_yield_tasks(package, why, tmp_path):
    (task,) = synthesise([parse_package(package)], tmp_path / "out", n=1, seed=0, max_candidates=4)
    with get_engine("local") as engine, engine.start(task) as sb:  # materialised from the row alone
        sb.write_file(".git/crr/gold.patch", task.patch.encode())
        assert sb.exec("git apply .git/crr/gold.patch", timeout=60).exit_code == 0
        assert verify(sb, task, timeout=300).reward == 1.0, why


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_import_roots_follow_the_build_declaration(tmp_path):
    flat = write_tree(tmp_path / "flat", {"pkg/__init__.py": "", "src/notes.txt": "", "tests/test_a.py": ""})
    assert import_roots(flat) == []
    src = write_tree(tmp_path / "src", {"src/pkg/__init__.py": "", "tests/test_a.py": ""})
    assert import_roots(src) == ["src"]
    for name, files in {
        "setuptools": {"pyproject.toml": '[tool.setuptools.packages.find]\nwhere = ["lib"]\n'},
        "package-dir": {"pyproject.toml": '[tool.setuptools]\npackage-dir = {"" = "lib"}\n'},
        "hatch": {"pyproject.toml": '[tool.hatch.build.targets.wheel]\npackages = ["lib/pkg"]\n'},
        "poetry": {"pyproject.toml": '[tool.poetry]\npackages = [{include = "pkg", from = "lib"}]\n'},
        "setup.cfg": {"setup.cfg": "[options]\npackage_dir =\n    =lib\n"},
        "setup.py": {"setup.py": "from setuptools import setup\nsetup(package_dir={'': 'lib'})\n"},
    }.items():
        assert import_roots(write_tree(tmp_path / name, {**files, "lib/pkg/__init__.py": ""})) == ["lib"], name


def test_the_test_command_follows_what_the_pytest_configuration_needs(tmp_path):
    src = write_tree(tmp_path / "src", {"src/pkg/__init__.py": "", "pyproject.toml": '[tool.pytest.ini_options]\n'
                                        'addopts = "--color=yes --cov=pkg"\n'})
    assert _pytest_setup(DEFAULT_TEST_CMD, src) == (f"{DEFAULT_TEST_CMD} -o pythonpath=src --color=no --no-cov",
                                                    [PYTEST_COV])
    own = write_tree(tmp_path / "own", {"src/pkg/__init__.py": "", "pytest.ini": "[pytest]\npythonpath = src\n"})
    assert _pytest_setup(DEFAULT_TEST_CMD, own) == (DEFAULT_TEST_CMD, [])  # its configuration already does it
    assert _pytest_setup("python -m unittest", src) == ("python -m unittest", [])


# An in-tree PEP 517 backend that is setuptools' own plus a marker written to a host path from each hook pip
# calls to prepare the metadata: code of the package's author, which must never run on the host.
HOSTILE_BACKEND = """import os
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403


def _mark(hook):
    os.makedirs({marks!r}, exist_ok=True)
    with open(os.path.join({marks!r}, hook), "w") as f:
        f.write(str(os.getuid()))


def get_requires_for_build_wheel(config_settings=None):
    _mark("get_requires_for_build_wheel")
    return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _mark("prepare_metadata_for_build_wheel")
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
"""


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def docker_engine(request):
    """What synth hands the metadata build: the Docker engine, or None (the local engine: bubblewrap)."""
    if request.param == "local":
        yield None
    else:
        with get_engine("docker") as engine:
            yield engine


def test_dependencies_come_from_metadata_built_in_a_sandbox_when_pkg_info_has_none(tmp_path, docker_engine):
    """An sdist whose PKG-INFO has no Requires-Dist gets them from its build backend, run in a sandbox with no
    network that sees none of this machine's files (bubblewrap for the local engine, a container of the base
    image for Docker): the requirements come back, and what the backend wrote to a host path never lands."""
    setup = ("from setuptools import setup\nsetup(name='old', version='1.0', py_modules=['old'], "
             "install_requires=['six>=1.9'], extras_require={'test': ['iniconfig'], 'yaml': ['pyyaml']})\n")
    plain = write_tree(tmp_path / "old", {"PKG-INFO": "Metadata-Version: 1.1\nName: old\nVersion: 1.0\n",
                                          "setup.py": setup, "old.py": "import six\n"})
    assert sorted(declared_requirements(plain, docker_engine)) == ["iniconfig", "six>=1.9"]
    assert sorted(p.name for p in plain.iterdir()) == ["PKG-INFO", "old.py", "setup.py"]  # built elsewhere

    marks = tmp_path / "marks"  # a host path the backend can name: under /tmp, as the sandbox's own /tmp is
    hostile = write_tree(tmp_path / "hostile", {
        "PKG-INFO": "Metadata-Version: 2.1\nName: old\nVersion: 1.0\n", "setup.py": setup, "old.py": "",
        "backend.py": HOSTILE_BACKEND.format(marks=str(marks)),
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=40.8.0"]\nbuild-backend = "backend"\n'
                          'backend-path = ["."]\n'})
    assert sorted(declared_requirements(hostile, docker_engine)) == ["iniconfig", "six>=1.9"]  # the hooks did run
    assert not marks.exists()  # ... but not here
