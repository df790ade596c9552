"""The sandbox layer's two doors, for real: the package mirror (wheels from PyPI pinned by sha256,
installed in sandboxes that have no network) and HTTP record/replay (a test suite whose request to a
live server is recorded once, by the determinism filter's gold run, and replayed everywhere after)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent_tasks import CALC, CALC_FIXED, TEST_CMD, TESTS, TESTS_WITH_ADD, file_diff
from crr.agent.verifier import verify
from crr.errors import CRRError, TaskFormatError
from crr.filter.determinism import ADMITTED, DISCARDED, HTTP_NOT_RECORDED, RESULTS, FilterConfig, filter_tasks
from crr.sandbox import get_engine, http, mirror
from crr.rundir import RunDir
from crr.tasks.loaders import load_tasks
from crr.tasks.schema import LOCK_LINE, Task
from crr.tasks.synth import PYTEST


@pytest.fixture(scope="module")
def lock_lines() -> list[str]:
    return mirror.lock([PYTEST])  # the lock of every synthesised task: resolved once per session


def env_task(make_task, lines: list[str], instance_id: str, extra: dict[str, str] | None = None) -> Task:
    """The calc task (add() subtracts) with an environment and optional extra P2P test files."""
    extra = extra or {}
    p2p = ["tests/test_calc.py::test_mul"] + [f"{path}::{line[4:line.index('(')]}" for path, text in extra.items()
                                              for line in text.splitlines() if line.startswith("def test_")]
    return make_task({"calc.py": CALC, "tests/test_calc.py": TESTS, **extra}, instance_id=instance_id,
                     repo="local/calc", patch=file_diff("calc.py", CALC, CALC_FIXED),
                     test_patch=file_diff("tests/test_calc.py", TESTS, TESTS_WITH_ADD),
                     FAIL_TO_PASS=("tests/test_calc.py::test_add",), PASS_TO_PASS=tuple(p2p), test_cmd=TEST_CMD,
                     mirror={"requirements": lines})


def filter_run(tmp_path: Path, tasks: list[Task], config: FilterConfig) -> tuple[RunDir, dict[str, dict]]:
    run = RunDir.create("filter-tasks", "test", root=tmp_path / "runs")
    filter_tasks(tasks, run, config, workers=1)
    return run, {r["instance_id"]: r for r in run.records(RESULTS)}


def apply_gold(sb, task: Task) -> None:
    sb.write_file(".git/crr/gold.patch", task.patch.encode())
    assert sb.exec("git apply .git/crr/gold.patch", timeout=60).exit_code == 0


# -- the package mirror ---------------------------------------------------------------------------

def test_the_lock_pins_every_wheel_of_the_closure_by_hash(lock_lines):
    names = {line.split("==")[0] for line in lock_lines}
    assert {"pytest", "pluggy", "iniconfig", "packaging", "pip", "vcrpy", "pyyaml", "wrapt"} <= names
    assert all(LOCK_LINE.fullmatch(line) for line in lock_lines)
    assert mirror.lock([PYTEST]) == lock_lines  # resolved once, then frozen
    house = mirror.wheelhouse(lock_lines)
    pins = {f"{line.split(' ')[0]}": line.rpartition(":")[2] for line in lock_lines}
    wheels = sorted(house.glob("*.whl"))
    assert len(wheels) == len(lock_lines)
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        name = name.lower().replace("_", "-")
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() == pins[f"{name}=={version}"]


def test_sandboxes_install_from_the_wheelhouse_only_and_get_identical_bytes(make_task, lock_lines):
    task = env_task(make_task, lock_lines, "mirror-1")
    pins = {line.split("==")[0]: line.rpartition(":")[2] for line in lock_lines}
    install = ("pip install -q --no-compile --target $TMPDIR/t iniconfig && cd $TMPDIR/t && "
               "find . -type f | sort | xargs sha256sum")
    with get_engine("local") as engine:
        with engine.start(task) as sb:
            assert sb.exec("python -m pytest --version", timeout=60).output.strip() == "pytest 8.3.5"
            got = sb.exec("pip download --no-deps -q -d $TMPDIR/w iniconfig pluggy && cd $TMPDIR/w && "
                          "sha256sum *.whl", timeout=120)
            assert got.exit_code == 0, got.output
            assert sorted(line.split()[0] for line in got.output.splitlines()) == sorted(
                [pins["iniconfig"], pins["pluggy"]])
            tree = sb.exec(install, timeout=120)
            assert tree.exit_code == 0 and "iniconfig/__init__.py" in tree.output, tree.output
            missing = sb.exec("pip install --target $TMPDIR/u requests", timeout=120)
            assert missing.exit_code != 0 and "No matching distribution" in missing.output
            offline = sb.exec("python -c \"import urllib.request; urllib.request.urlopen("
                              "'https://pypi.org/simple/', timeout=5)\"", timeout=60)
            assert offline.exit_code != 0  # no network: the wheelhouse is the only door
            assert "Read-only" in sb.exec("touch /opt/crr/env/x", timeout=10).output
        with engine.start(task) as sb:  # another sandbox, the same bytes
            assert sb.exec(install, timeout=120).output == tree.output


def test_a_wheel_that_does_not_match_its_lock_is_never_installed(tmp_path, lock_lines):
    iniconfig = next(line for line in lock_lines if line.startswith("iniconfig=="))
    forged = iniconfig.split(" --hash")[0] + " --hash=sha256:" + "0" * 64
    with pytest.raises(CRRError, match="does not match the sha256 its lock pins"):
        mirror.wheelhouse([forged])
    # A wheelhouse damaged after the download: the install refuses it.
    root = tmp_path / "env"
    mirror.stage(lock_lines, root)
    wheel = next((root / "wheelhouse").glob("iniconfig-*.whl"))
    data = wheel.read_bytes()
    wheel.unlink()  # a hard link to the shared wheelhouse: replace it, never write through it
    wheel.write_bytes(data + b"\0")
    out = subprocess.run(["bash", "-c", mirror.install_script(str(root), sys._base_executable)],
                         capture_output=True, text=True, check=False, env={"PATH": mirror.SYSTEM_PATH})
    assert out.returncode != 0 and "DO NOT MATCH THE HASHES" in out.stdout + out.stderr


def test_malformed_replay_fields_are_refused():
    row = {"instance_id": "t", "repo": "r", "base_commit": "c", "problem_statement": "", "patch": "",
           "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": [], "version": "0"}
    with pytest.raises(TaskFormatError, match="not a pinned, hashed requirement"):
        Task.from_row({**row, "mirror": {"requirements": ["pytest>=8"]}})
    with pytest.raises(TaskFormatError, match="http_replay.sha256"):
        Task.from_row({**row, "http_replay": {"cassette": "c.yaml", "sha256": "abc"}})
    with pytest.raises(TaskFormatError, match=r"sdist': missing \['sha256'\]"):
        Task.from_row({**row, "sdist": {"name": "x", "version": "1", "filename": "x-1.tar.gz"}})


# -- HTTP record/replay -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    """A live HTTP server on the host's loopback: reachable only from a recording sandbox."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            self.server.hits += 1
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"42")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    httpd.hits = 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def http_task(make_task, lines: list[str], port: int, instance_id: str) -> Task:
    api = ("import urllib.request\n\n\n"
           "def test_answer():\n"
           f"    assert urllib.request.urlopen('http://127.0.0.1:{port}/answer', timeout=5).read() == b'42'\n")
    return env_task(make_task, lines, instance_id, {"tests/test_api.py": api})


def test_http_is_recorded_once_by_the_gold_run_and_replayed_with_no_network(tmp_path, make_task, lock_lines,
                                                                            server):
    task = http_task(make_task, lock_lines, server.server_port, "http-1")
    hits = server.hits
    run, records = filter_run(tmp_path, [task], FilterConfig(reruns=2, timeout=120, record_http=True))
    assert records["http-1"]["verdict"] == ADMITTED, records["http-1"]
    assert server.hits == hits + 1  # the recording run only: the pre-check and the reruns replayed
    (admitted,) = load_tasks(str(run.path / "admitted.jsonl"))
    cassette = Path(admitted.http_replay["cassette"])
    assert cassette.parent == run.path / "cassettes" and "/answer" in cassette.read_text()
    with get_engine("local") as engine, engine.start(admitted) as sb:  # a rollout sandbox, later
        apply_gold(sb, admitted)
        result = verify(sb, admitted, timeout=120)
    assert result.reward == 1.0 and result.statuses["tests/test_api.py::test_answer"] == "PASSED"
    assert server.hits == hits + 1
    cassette.write_text(cassette.read_text().replace("42", "43"))
    with get_engine("local") as engine, pytest.raises(CRRError, match="does not match the sha256"):
        engine.start(admitted)


def test_a_request_with_no_recording_excludes_the_task(tmp_path, make_task, lock_lines, server):
    task = http_task(make_task, lock_lines, server.server_port, "http-2")
    hits = server.hits
    _, records = filter_run(tmp_path, [task], FilterConfig(reruns=2, timeout=120))
    record = records["http-2"]
    assert record["verdict"] == DISCARDED and record["reason"] == HTTP_NOT_RECORDED
    assert f"GET http://127.0.0.1:{server.server_port}/answer" in record["detail"]
    assert record["tests"] == {"tests/test_api.py::test_answer": ["FAILED"]} and server.hits == hits


@pytest.mark.docker
def test_record_and_replay_on_the_docker_engine(tmp_path, make_task, lock_lines, server):
    task = http_task(make_task, lock_lines, server.server_port, "http-docker")
    hits = server.hits
    run, records = filter_run(tmp_path, [task], FilterConfig(engine="docker", engine_options={"mode": "commit"},
                                                            reruns=2, timeout=300, record_http=True))
    assert records["http-docker"]["verdict"] == ADMITTED, records["http-docker"]
    assert server.hits == hits + 1
    (admitted,) = load_tasks(str(run.path / "admitted.jsonl"))
    with get_engine("docker", mode="overlay") as engine, engine.start(admitted) as sb:
        assert sb.exec("python -m pytest --version", timeout=60).output.strip() == "pytest 8.3.5"
        apply_gold(sb, admitted)
        assert sb.read_file(http.CASSETTE) == Path(admitted.http_replay["cassette"]).read_bytes()
        assert verify(sb, admitted, timeout=300).reward == 1.0
    assert server.hits == hits + 1


def test_building_publishes_a_folder_whole_or_not_at_all(tmp_path):
    from crr.sandbox.checkout import building

    dest = tmp_path / "d"
    with pytest.raises(RuntimeError), building(dest) as b:
        b.mkdir()
        (b / "x").write_text("1")
        raise RuntimeError("crash mid-build")
    assert list(tmp_path.iterdir()) == []          # nothing half-built, no temporary sibling left
    dest.mkdir()                                   # an empty folder is replaced
    with building(dest, keep_theirs=lambda _: False) as b:
        b.mkdir()
        (b / "x").write_text("1")
    with building(dest) as b:                      # filled meanwhile and whole: theirs is kept
        b.mkdir()
        (b / "x").write_text("2")
    with pytest.raises(CRRError, match="written by someone else"), building(dest, keep_theirs=lambda _: False) as b:
        b.mkdir()
    assert (dest / "x").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["d"]
