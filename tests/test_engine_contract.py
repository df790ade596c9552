"""The fork-engine contract, run against every engine: one parameter list, the same tests.

What every engine promises the episode loop, the verifier, the trainer and the filter (crr.sandbox.base):
start, exec (exit codes, output, env, timeouts that kill the whole tree, bounded output), files confined to
the repository, snapshot and exact restore (fork of fork), isolated forks, release, close, gc that spares a
live engine, a per-file cap, and bad input or lost infrastructure as a CRRError, never a hang or a reward.

A new backend gets these tests by adding one line to ENGINES: its engine spec (a registered name, or the
dotted path to its class, as `--engine` takes it), with options that cap any one file at CAP_MB. Each engine
is made once per module, and the tests share it; each test's sandboxes are its own.
Engine-specific behaviour (overlay layers, Docker images and labels, cgroups) stays in test_local_engine.py,
test_docker_engine.py and test_ray_engine.py.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from conftest import git_repo, procs_with

from crr.errors import CRRError
from crr.sandbox import EngineSpec, engine_spec, reclaim_leftovers
from crr.sandbox.base import MAX_OUTPUT_BYTES, ForkEngine, Sandbox, Snapshot, tree_digest
from crr.tasks.schema import Task

CAP_MB = 1  # every engine below is made with this per-file cap
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="overlayfs and namespaces need root")
ENGINES = [
    pytest.param(EngineSpec("local", {"fsize_limit_mb": CAP_MB}), marks=needs_root, id="local-overlay"),
    pytest.param(EngineSpec("local", {"fsize_limit_mb": CAP_MB, "overlay": False}), id="local-copy"),
    pytest.param(EngineSpec("docker", {"mode": "commit", "fsize_limit_mb": CAP_MB}), marks=pytest.mark.docker,
                 id="docker-commit"),
    pytest.param(EngineSpec("docker", {"mode": "overlay", "fsize_limit_mb": CAP_MB}), marks=pytest.mark.docker,
                 id="docker-overlay"),
    # out of tree, by dotted path (tests/toy_engine.py; ARCHITECTURE.md "A new fork engine")
    pytest.param(EngineSpec("toy_engine:ToyEngine", {"fsize_limit_mb": CAP_MB}), id="toy-out-of-tree"),
]

FILES = {"README.md": "hello\n", "pkg/__init__.py": "", "pkg/core.py": "def f():\n    return 1\n",
         "pkg/sub/deep.py": "X = 1\n", "run.sh": "#!/bin/sh\necho run\n", "gone/a.txt": "a\n"}
# Every kind of change a fork must reproduce: contents, modes, deletions (a file, a whole dir, then the dir
# re-created), new files in new nested dirs, symlinks to a file and a dir, an empty dir.
EDITS = ("printf 'def f():\\n    return 2\\n' > pkg/core.py && chmod 755 run.sh && chmod 600 pkg/sub/deep.py "
         "&& rm README.md && rm -r gone && mkdir -p gone new/a/b empty && echo fresh > gone/c.txt "
         "&& echo n > new/a/b/n.py && ln -s pkg/core.py link.py && ln -s pkg dirlink")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    repo = tmp_path_factory.mktemp("contract-repo")
    return Task(instance_id="contract-1", repo="local/contract", base_commit=git_repo(repo, FILES),
                problem_statement="", patch="", test_patch="", FAIL_TO_PASS=(), PASS_TO_PASS=(), version="0",
                repo_src=str(repo))


@pytest.fixture(scope="module", params=ENGINES)
def spec(request) -> EngineSpec:
    if request.node.get_closest_marker("docker"):
        from crr.errors import SandboxError
        from crr.sandbox.docker import docker_client

        try:
            docker_client()
        except SandboxError as e:
            pytest.skip(str(e))
    return engine_spec(request.param)   # checked by the engine, as every command's --engine is


@pytest.fixture(scope="module")
def engine(spec) -> ForkEngine:
    eng = spec.make()
    yield eng
    eng.close()


def test_start_exec_and_files(engine, task):
    assert isinstance(engine, ForkEngine)
    with engine.start(task) as sb:
        assert isinstance(sb, Sandbox) and sb.task is task
        res = sb.exec("echo out; echo err >&2; pwd; exit 3")
        assert (res.exit_code, res.output, res.timed_out) == (3, f"out\nerr\n{sb.repo_dir}\n", False)
        assert sb.exec('echo "$TZ $PYTHONHASHSEED $FOO"', env={"FOO": "bar baz"}).output == "UTC 0 bar baz\n"
        assert sb.exec("cat").output == ""  # stdin is empty, never the host's
        assert sb.exec("kill -9 $$").exit_code == 137
        assert sb.read_file("pkg/core.py") == b"def f():\n    return 1\n"
        assert sb.exec("ln -s /etc etc_link && ln -s ../../etc/passwd pkg/pw").exit_code == 0
        for bad in ("../etc/passwd", "/etc/passwd", "pkg/../../etc/passwd", "etc_link/passwd", "pkg/pw", ""):
            with pytest.raises(CRRError):
                sb.read_file(bad)
        for bad in ("etc_link/evil", "/tmp/evil", "pkg/../../evil"):
            with pytest.raises(CRRError):
                sb.write_file(bad, b"x")
        with pytest.raises(CRRError, match="no such file|cannot read"):
            sb.read_file("missing.txt")
        sb.write_file("a/b/new.txt", b"\x00\xffbytes")   # parents made, bytes kept
        assert sb.read_file("a/b/new.txt") == b"\x00\xffbytes"


def test_restore_is_exact_and_forks_of_forks_too(engine, task):
    with engine.start(task) as sb:
        base = tree_digest(sb)
        assert sb.exec(EDITS).exit_code == 0
        edited = tree_digest(sb)
        assert edited != base
        snap = sb.snapshot()
        with engine.restore(snap) as fork:
            assert tree_digest(fork) == edited
            assert fork.exec("test -x run.sh && ! test -e README.md && test -d empty && test \"$(readlink "
                             "link.py)\" = pkg/core.py && test \"$(readlink dirlink)\" = pkg").exit_code == 0
            status = "git status --porcelain | sort"
            assert fork.exec(status).output == sb.exec(status).output
            assert fork.exec("rm pkg/core.py && echo again >> gone/c.txt && chmod 700 new").exit_code == 0
            deeper = tree_digest(fork)
            snap2 = fork.snapshot()
        with engine.restore(snap2) as fork2:
            assert tree_digest(fork2) == deeper
        engine.release(snap2)
        engine.release(snap)


def test_forks_are_isolated_and_outlive_their_released_snapshot(engine, task):
    with engine.start(task) as parent:
        parent.write_file("shared.txt", b"parent\n")
        snap = parent.snapshot()
        with engine.restore(snap) as a, engine.restore(snap) as b:
            a.write_file("shared.txt", b"a\n")
            a.exec("rm pkg/core.py")
            b.write_file("only_b.txt", b"b\n")
            parent.write_file("after.txt", b"late\n")
            assert a.read_file("shared.txt") == b"a\n" and b.read_file("shared.txt") == b"parent\n"
            assert parent.read_file("shared.txt") == b"parent\n"
            assert b.exec("test -e pkg/core.py").exit_code == 0 and parent.exec("test -e pkg/core.py").exit_code == 0
            assert a.exec("test -e only_b.txt || test -e after.txt").exit_code == 1
            assert b.exec("test -e after.txt").exit_code == 1
            engine.release(snap)   # a released snapshot lives while its forks do
            engine.release(snap)   # idempotent
            with pytest.raises(CRRError, match="not held"):
                engine.restore(snap)
            assert a.read_file("shared.txt") == b"a\n" and b.exec("cat only_b.txt").output == "b\n"
        a.close()                  # idempotent
        with pytest.raises(CRRError):
            a.exec("true")


def test_timeouts_kill_the_whole_tree_and_output_and_files_are_bounded(engine, task):
    with engine.start(task) as sb:
        t0 = time.monotonic()
        res = sb.exec("sleep 303.7 & (setsid sleep 304.7 &); echo started; sleep 30", timeout=1)
        assert (res.exit_code, res.timed_out) == (124, True) and "started" in res.output
        assert time.monotonic() - t0 < 8
        t0 = time.monotonic()   # a command that ends while its background child lives on returns at once
        assert sb.exec("sleep 305.7 & echo bg", timeout=20).output == "bg\n" and time.monotonic() - t0 < 5
        assert sb.exec("exit 124", timeout=20).timed_out is False   # exiting 124 by itself is no timeout
        assert procs_with("sleep", "303.7") == procs_with("sleep", "304.7") == procs_with("sleep", "305.7") == []
        res = sb.exec("head -c 3000000 /dev/zero | tr '\\0' x; echo; echo END", timeout=60)
        assert res.exit_code == 0 and res.truncated and res.output.endswith("END\n")
        assert res.output.startswith("xxx") and len(res.output.encode()) <= MAX_OUTPUT_BYTES + 100
        res = sb.exec(f"head -c {2 * CAP_MB << 20} /dev/zero > big.bin", timeout=60)
        assert res.exit_code != 0 and len(sb.read_file("big.bin")) == CAP_MB << 20


def test_bad_input_and_lost_infrastructure_are_crr_errors(spec, engine, task, tmp_path):
    with pytest.raises(CRRError, match="no_such_option"):   # the engine checks its options before it starts
        engine_spec(spec.name, {**spec.options, "no_such_option": 1})
    nowhere = dataclasses.replace(task, instance_id="contract-gone", repo_src=str(tmp_path / "no-such-repo"))
    with pytest.raises(CRRError):
        engine.start(nowhere)
    with pytest.raises(CRRError, match="not held"):
        engine.restore(Snapshot("no-such-snapshot", engine.name, task.instance_id))


def test_gc_spares_a_live_engine_and_close_takes_everything(engine, task):
    """Last in this module: it closes the module's engine (its fixture's close is then a no-op)."""
    eng = engine
    sb = eng.start(task)
    sb.exec("echo x > f.txt && (sleep 306.7 &)")
    snap = sb.snapshot()
    fork = eng.restore(snap)
    fork.snapshot()                 # left unreleased, like `fork`, `sb` and `snap`
    reclaim_leftovers()             # `crr sandbox gc`: only what dead processes left
    assert fork.read_file("f.txt") == b"x\n" and sb.exec("echo alive").output == "alive\n"
    eng.close()
    eng.close()                     # idempotent
    with pytest.raises(CRRError):
        sb.exec("true")
    with pytest.raises(CRRError, match="closed"):
        eng.start(task)
    assert procs_with("sleep", "306.7") == []
