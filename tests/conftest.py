"""Shared fixtures: offline, isolated caches, and real git-backed tasks.

Every test session gets its own CRR_CACHE_DIR (base checkouts, sandboxes) so tests never write to
~/.cache, and HF_HUB_OFFLINE=1 so nothing reaches for a model hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from crr.bench.fork import commit_all
from crr.tasks.schema import Task


def pytest_configure(config: pytest.Config) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    # Every model here is tiny: decoding and training are many small ops, and on 2 cores one torch thread beats
    # several spinning against each other (about 5x on a busy machine; the vLLM check 229 s -> 81 s). Set before
    # anything imports torch, so this process and every crr process a test starts (they inherit it) use one.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CRR_CACHE_DIR"] = tempfile.mkdtemp(prefix="crr-test-cache-")


# `make test` runs the suite on two workers (pytest-xdist, `--dist loadfile --no-loadscope-reorder`), then the
# `serial` tests alone. Each module runs whole on one worker, so its module and session fixtures are made once.
# Modules that share something machine-wide which the other worker would disturb share one worker: the Ray
# modules (one Ray cluster at a time) and the fork bench's (test_ray_engine's bench checks that no fork-bench
# directory is left in the system's temporary directory, test_fork_bench's make them). The slowest modules start
# first (longest first: otherwise the last one to start sets the wall clock), the rest in file order.
# (xdist's own `--dist loadgroup` reads groups from item._nodeid, which pytest 9 no longer has: it groups nothing.)
SHARE_A_WORKER = {"test_ray_cli": "ray", "test_ray_engine": "ray", "test_fork_bench": "ray"}
SLOWEST_FIRST = ["test_vllm_backend", "test_ray_cli", "test_ray_engine", "test_fork_bench", "test_sft",
                 "test_interrupt", "test_report", "test_trainer", "test_train_multiprocess", "test_band"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: file order within a rank


@pytest.hookimpl(optionalhook=True)  # pytest without xdist runs the suite too
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        """--dist loadfile, with the modules of SHARE_A_WORKER as one."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARE_A_WORKER.get(Path(module).stem, module)

    return ModuleScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = os.environ.pop("CRR_CACHE_DIR", None)
    if cache and Path(cache).name.startswith("crr-test-cache-"):
        # A leaked mount would make rmtree delete through it; unmount first (tests check for leaks).
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(cache + "/")]
        for mnt in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head raylet and a worker raylet,
    one CPU and two `crr_sandbox` slots each), this process connected to it; shut down, and its session
    logs removed, after the module."""
    ray = pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"crr_sandbox": 2, "head": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"crr_sandbox": 2, "worker": 1})
    session = c.head_node.get_session_dir_path()
    try:
        ray.init(address=c.address, configure_logging=False)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(session, ignore_errors=True)  # its logs: a few hundred KB a run
        latest = Path(session).parent / "session_latest"
        if latest.is_symlink() and os.readlink(latest) == session:
            latest.unlink()  # left pointing at nothing


def git_repo(path: Path, files: dict[str, str]) -> str:
    """Make a git repository at `path` holding `files` in one commit; returns the commit sha."""
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return commit_all(path)


# A task the untrained tiny model sometimes solves (shared by the trainer and report tests): the hidden test
# passes iff the agent ran the test suite unfiltered before submitting (the conftest leaves a marker when pytest
# runs without node ids; the verifier passes node ids). The tiny model calls run_tests often but not always, so
# returns differ between siblings and between branches: real contrasts.
RAN_CONFTEST = '''import pathlib

import _pytest.terminal

_pytest.terminal.format_session_duration = lambda s: "(time)"


def pytest_configure(config):
    if not any("::" in a for a in config.invocation_params.args):
        pathlib.Path("ran.txt").write_text("1")
'''
_TEST_RAN = "import pathlib\n\n\ndef test_ran():\n    assert pathlib.Path('ran.txt').exists()\n"
RAN_PATCH = ("--- /dev/null\n+++ b/tests/test_ran.py\n@@ -0,0 +1,5 @@\n"
             + "".join(f"+{line}\n" for line in _TEST_RAN.splitlines()))


def ran_task(root: Path, instance_id: str = "ran-1", repo: str | None = None) -> Task:
    """The run-the-tests task over a real git repository made under `root`."""
    src = Path(tempfile.mkdtemp(dir=root, prefix=f"repo-{instance_id}-"))
    commit = git_repo(src, {"conftest.py": RAN_CONFTEST, "tests/test_ok.py": "def test_ok():\n    assert True\n",
                            "a.py": "x = 1\n"})
    return Task(instance_id=instance_id, repo=repo or f"local/{instance_id}", base_commit=commit, patch="",
                problem_statement="Run the test suite, then submit.", test_patch=RAN_PATCH,
                FAIL_TO_PASS=("tests/test_ran.py::test_ran",), PASS_TO_PASS=("tests/test_ok.py::test_ok",),
                version="0", repo_src=str(src), test_cmd="python3 -m pytest -rA -p no:cacheprovider")


@pytest.fixture(scope="session")
def ran_tasks_file(tmp_path_factory) -> Path:
    """tasks.jsonl holding the one run-the-tests task."""
    from crr.tasks.loaders import write_tasks

    root = tmp_path_factory.mktemp("ran-task")
    return write_tasks([ran_task(root)], root / "tasks.jsonl")


@pytest.fixture
def make_task(tmp_path: Path) -> Callable[..., Task]:
    """make_task(files, instance_id="t1", **task_fields) -> a Task over a real, committed git repo."""

    def make(files: dict[str, str], instance_id: str = "t1", **task_fields) -> Task:
        repo = Path(tempfile.mkdtemp(dir=tmp_path, prefix=f"repo-{instance_id}-"))
        commit = git_repo(repo, files)
        defaults = {"instance_id": instance_id, "repo": f"local/{instance_id}", "base_commit": commit,
                    "problem_statement": "", "patch": "", "test_patch": "", "FAIL_TO_PASS": (),
                    "PASS_TO_PASS": (), "version": "0", "repo_src": str(repo)}
        return Task(**{**defaults, **task_fields})

    return make


@pytest.fixture
def task(make_task):
    """The calc task of tests/agent_tasks.py (a module may define its own `task`)."""
    from agent_tasks import calc_task

    return calc_task(make_task)


@pytest.fixture
def engine():
    """A local engine (a module may define its own `engine`, e.g. over several engines)."""
    from crr.sandbox import get_engine

    with get_engine("local") as eng:
        yield eng


# Execs `python -m crr ARGS` with SIGINT at its default, as a shell starts a command: pytest-xdist's workers ignore
# SIGINT, a child inherits that, and Python keeps an inherited "ignore" (so a Ctrl-C test would test nothing).
_AS_FROM_A_SHELL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.executable, [sys.executable, '-m', 'crr', *sys.argv[1:]])")


def crr_process(*args: str, **popen_kw) -> subprocess.Popen:
    """`crr ARGS` as a child process running this source tree (not whichever crr is installed), started as a shell
    starts it (the same pid, its command line `python -m crr ARGS`)."""
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **popen_kw.pop("env", {})}
    return subprocess.Popen([sys.executable, "-c", _AS_FROM_A_SHELL, *args], env=env, **popen_kw)


def procs_with(*argv: str) -> list[int]:
    """Pids whose command line is exactly `argv`."""
    want = "\0".join(argv).encode() + b"\0"
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes() == want:
                pids.append(int(d.name))
        except OSError:
            pass
    return pids
