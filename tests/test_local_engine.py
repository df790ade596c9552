"""The local fork engine on real git repositories, real processes and real overlay mounts: what is its own
(overlay layers, namespaces, cgroups, gc of its mounts). What every engine does: test_engine_contract.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import procs_with

from crr.errors import CRRError, SandboxError
from crr.sandbox import engine_spec, get_engine
from crr.sandbox.base import tree_digest
from crr.sandbox.local import LocalEngine, gc_leftovers
from crr.sandbox.local.cgroups import _memory_cgroup_root
from crr.sandbox.overlay import OverlayWorkspace

FILES = {"README.md": "hello\n", "pkg/__init__.py": "", "pkg/core.py": "def f():\n    return 1\n",
         "pkg/sub/deep.py": "X = 1\n", "docs/guide.txt": "guide\n", "gone/a.txt": "a\n", "gone/b.txt": "b\n"}

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="overlayfs and namespaces need root")


@pytest.fixture(params=[pytest.param(True, marks=needs_root, id="overlay"), pytest.param(False, id="copy")])
def engine(request, tmp_path):
    eng = LocalEngine(workdir=tmp_path / "sandboxes", overlay=request.param)
    yield eng
    eng.close()
    assert not _mounts_under(tmp_path), "a mount outlived its engine"


@pytest.fixture
def overlay_engine(tmp_path):
    """For what only the overlay mode has (stacked layers); the contract suite forks both modes."""
    if os.geteuid() != 0:
        pytest.skip("overlayfs and namespaces need root")
    with LocalEngine(workdir=tmp_path / "sandboxes", overlay=True) as eng:
        yield eng
    assert not _mounts_under(tmp_path), "a mount outlived its engine"


@pytest.fixture
def task(make_task):
    return make_task(FILES)


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line for line in f if line.split()[1].startswith(str(path))]


def test_registry(engine):
    assert isinstance(get_engine("local", workdir=engine.workdir), LocalEngine)
    with pytest.raises(CRRError, match="choose one of local, docker"):
        get_engine("vm")




def test_fork_of_fork_ten_generations(overlay_engine, task):
    """Ten generations stay two lower layers deep (a copy-mode fork is a plain copy: the contract suite)."""
    engine = overlay_engine
    sb = engine.start(task)
    expected = {}
    for gen in range(10):
        edit = f"echo {gen} > gen{gen}.txt && echo {gen} >> pkg/core.py"
        if gen == 2:
            edit += " && rm -r pkg/sub"          # a whiteout over a base dir
        if gen == 4:
            edit += " && mkdir pkg/sub && echo new > pkg/sub/other.py"  # recreated: must stay opaque
        if gen == 6:
            edit += " && rm gen1.txt"            # a whiteout over a layer-only file
        assert sb.exec(edit).exit_code == 0
        expected[gen] = tree_digest(sb)
        snap = sb.snapshot()
        child = engine.restore(snap)
        engine.release(snap)                     # the child keeps its layer alive
        sb.close()
        assert tree_digest(child) == expected[gen]
        (mount,) = _mounts_under(child.workspace.tree)
        lowers = mount.split("lowerdir=")[1].split(",")[0].split(":")
        assert len(lowers) == 2, lowers          # flattened: layer + base, however deep
        sb = child
    assert sb.exec("test -e pkg/sub/deep.py").exit_code == 1  # the base's deep.py stays hidden
    assert sb.read_file("pkg/sub/other.py") == b"new\n"
    assert sb.exec("ls gen*.txt").output.split() == [f"gen{g}.txt" for g in range(10) if g != 1]
    assert sb.read_file("pkg/core.py").endswith(b"".join(b"%d\n" % g for g in range(10)))
    sb.close()
    assert sorted(p.name for p in engine.dir.iterdir()) == ["crr-owner.json"]  # layers freed by refcount


def test_release_keeps_layer_until_last_fork_closes(engine, task):
    with engine.start(task) as sb:
        sb.write_file("x.txt", b"x")
        snap = sb.snapshot()
        layer = Path(snap.handle["path"])
        fork = engine.restore(snap)
        engine.release(snap)
        engine.release(snap)  # idempotent
        assert fork.read_file("x.txt") == b"x"
        assert layer.exists() == (engine.mode == "overlay")  # a copy fork does not stack on its layer
        with pytest.raises(CRRError, match="not held"):
            engine.restore(snap)
        fork.close()
        assert not layer.exists()


def test_env_and_limits(engine, task):
    """The local engine's own environment and rlimits (exit codes, output and the file cap: the contract)."""
    with engine.start(task) as sb:
        env = sb.exec("command -v python; echo $HOME $LANG $PYTHONHASHSEED $PYTHONDONTWRITEBYTECODE")
        env = env.output.split()
        assert env[0] == str(Path(sys.executable).parent / "python")
        assert env[1] != os.environ.get("HOME") and env[2:] == ["C.UTF-8", "0", "1"]
        assert sb.exec("echo $PYTHONHASHSEED", env={"PYTHONHASHSEED": "7"}).output == "7\n"
        table = sb.exec("cat /proc/self/limits").output.splitlines()
        limits = {ln[:26].strip(): ln[26:].split() for ln in table}
        assert limits["Max address space"][:2] == [str(2048 << 20)] * 2
        assert limits["Max core file size"][:2] == ["0", "0"]
        assert limits["Max file size"][:2] == [str(1024 << 20)] * 2



def test_crr_s_own_pytest_plugins_stay_out_of_a_task_run_on_crr_s_interpreter(engine, make_task):
    """crr's interpreter stands in for a task without an environment; the plugins crr's own dependencies
    installed (pytest-xdist, -timeout, anyio) load on the host, not in the sandbox, unless a run names one."""
    task = make_task({"test_a.py": "def test_one():\n    assert True\n"})
    host = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "test_a.py"],
                          cwd=task.repo_src, capture_output=True, text=True, check=False)
    assert "plugins:" in host.stdout, "crr's environment installs no pytest plugin: this test would prove nothing"
    with engine.start(task) as sb:
        run = sb.exec("python -m pytest -rA -p no:cacheprovider test_a.py")
        assert run.exit_code == 0 and "1 passed" in run.output
        assert "plugins:" not in run.output, run.output
        named = sb.exec("python -m pytest -rA -p no:cacheprovider -p xdist test_a.py")
        assert "plugins: xdist" in named.output, named.output


def test_crr_s_editable_install_reads_empty_in_a_sandbox(engine, task):
    """crr's venv is bound into the sandbox, but its `__editable__` .pth (an import of setuptools' finder at
    every Python start, pointing at a source tree the sandbox does not hold) reads as empty there; the venv's
    packages still import."""
    import site

    pths = [p for d in site.getsitepackages() for p in Path(d).glob("__editable__*.pth")]
    assert pths and all(p.read_text().strip() for p in pths), "crr is not installed editable: this proves nothing"
    with engine.start(task) as sb:
        for p in pths:
            out = sb.exec(f"wc -c < {p}; echo extra >> {p}; wc -c < {p}")
            assert out.output.split()[0] == "0" and out.output.split()[-1] == "0", out.output
        run = sb.exec("python -c 'import pytest, sys; print(pytest.__name__, [m for m in sys.modules if "
                      "m.startswith(\"__editable__\")])'")
        assert run.output.strip() == "pytest []", run.output
    assert all(p.read_text().strip() for p in pths), "the host's .pth changed"


def test_a_checkout_under_tmp_runs_crr_s_interpreter_in_its_sandboxes(tmp_path):
    """crr's interpreter is bound into every sandbox root at its path, and the sandbox's private /tmp is bound
    there too: an interpreter under /tmp (a clone in /tmp, as CI may make) must be bound on top of that /tmp, or
    the sandbox's commands find the root filesystem's own python3 and pytest (another version, in the agent's
    observations and the verifier's runs) instead of crr's. Here crr runs from a virtual environment made under
    tmp_path (crr's dependencies reached by a .pth file)."""
    import site
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], str(Path(__file__).resolve().parents[1])]
    Path(purelib, "crr-deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    probe = textwrap.dedent("""
        from crr.sandbox import get_engine
        from crr.tasks.loaders import load_tasks
        with get_engine("local") as engine, engine.start(load_tasks("nano-band")[0]) as sb:
            print(sb.exec("python -c 'import sys; print(sys.prefix)'").output.strip())
    """)
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(venv), out.stdout


def test_bad_commands_are_crr_errors(engine, task):
    with engine.start(task) as sb:
        with pytest.raises(CRRError, match="NUL"):
            sb.exec("echo a\0b")
        with pytest.raises(CRRError, match="too long"):
            sb.exec("echo " + "x" * 200_000)
        assert sb.exec("echo ok").output == "ok\n"


def test_ctrl_c_during_a_command_kills_it(engine, task):
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with engine.start(task) as sb:
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                sb.exec("sleep 106.7 & sleep 106.7", timeout=30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        assert procs_with("sleep", "106.7") == []
        assert sb.exec("echo usable").output == "usable\n"


def test_overlay_refuses_paths_it_cannot_express(tmp_path):
    (tmp_path / "a:b").mkdir()
    with pytest.raises(CRRError, match="cannot take the path"):
        OverlayWorkspace(tmp_path / "ws", tmp_path / "a:b")
    assert not (tmp_path / "ws").exists()





@needs_root
def test_fork_bomb_is_bounded(task, tmp_path):
    with LocalEngine(workdir=tmp_path / "sb", pids_limit=32) as eng, eng.start(task) as sb:
        assert eng.enforced["pids_cgroup"] and eng.enforced["pid_namespace"]
        spawn = textwrap.dedent("""\
            import subprocess
            n = 0
            for _ in range(200):
                try:
                    subprocess.Popen(["sleep", "103.7"])
                    n += 1
                except OSError:
                    break
            print(n)
            """)
        res = sb.exec(f"python -c '{spawn}'", timeout=30)
        assert res.exit_code == 0, res.output
        assert 0 < int(res.output.split()[-1]) < 32  # the cgroup capped it
        assert procs_with("sleep", "103.7") == []  # and all of them died with the command
        res = sb.exec("while true; do sleep 104.7 & done", timeout=2)  # bash retries forks: a stall
        assert res.timed_out and procs_with("sleep", "104.7") == []
        assert sb.exec("echo alive").output == "alive\n"
    assert not (Path("/sys/fs/cgroup/pids/crr") / eng.dir.name).exists()  # the engine's cgroup went with it


_SERVE = """python -c "
import pathlib, socket, time
s = socket.socket(); s.bind(('127.0.0.1', 8765)); s.listen()
socket.create_connection(('127.0.0.1', 8765)); pathlib.Path('bound').touch(); print('served'); time.sleep(%s)"
"""


def test_no_network_but_a_private_loopback(overlay_engine, task):
    """(The network namespace is the same whatever the workspace mode.)"""
    engine = overlay_engine
    if not engine.enforced["net_namespace"]:
        pytest.skip("network namespaces are unavailable on this machine")
    with engine.start(task) as a, engine.start(task) as b, ThreadPoolExecutor(1) as pool:
        assert a.exec("tail -n +3 /proc/net/dev | cut -d: -f1").output.split() == ["lo"]
        res = a.exec("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"")
        assert res.exit_code != 0 and "unreachable" in res.output
        held = pool.submit(a.exec, _SERVE % 3)
        deadline = time.monotonic() + 10
        while not (a.workspace.tree / "bound").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (a.workspace.tree / "bound").exists()
        assert b.exec(_SERVE % 0).output == "served\n"  # the same port, held by `a` right now
        assert held.result().output == "served\n"


def test_paths_outside_the_repository_are_refused(engine, task, tmp_path):
    with engine.start(task) as sb:
        sb.exec("ln -s /etc etc_link && ln -s ../../.. up")
        for bad in ("../x", "/etc/passwd", "etc_link/passwd", "up/secret", "pkg/../../x"):
            with pytest.raises(CRRError, match="outside the repository"):
                sb.read_file(bad)
            with pytest.raises(CRRError, match="outside the repository"):
                sb.write_file(bad, b"nope")
        assert not (sb.workspace.tree.parent / "x").exists()
        sb.write_file(f"{sb.repo_dir}/pkg/abs.py", b"ok")  # absolute but inside: fine
        sb.write_file("brand/new/file.txt", b"made")
        assert sb.read_file("pkg/abs.py") == b"ok" and sb.read_file("brand/new/file.txt") == b"made"
        with pytest.raises(CRRError, match="cannot read"):
            sb.read_file("missing.txt")


def test_nothing_outlives_close_or_an_exception(engine, task):
    sb = engine.start(task)
    sb_root = sb.workspace.tree.parent.parent
    sb.close()
    sb.close()  # idempotent
    assert not sb_root.exists() and not _mounts_under(sb_root)
    with pytest.raises(CRRError, match="closed"):
        sb.exec("true")
    with pytest.raises(RuntimeError, match="agent crashed"), engine.start(task) as sb2:
        sb2.snapshot()
        raise RuntimeError("agent crashed")
    assert not _mounts_under(engine.dir)
    engine.start(task)  # left open: engine.close() must take it and its snapshots down
    engine.start(task).snapshot()
    engine.close()
    engine.close()
    assert not engine.dir.exists() and not _mounts_under(engine.workdir)
    with pytest.raises(CRRError, match="closed"):
        engine.start(task)


_CRASH = """
import json, os, sys, threading, time
from crr.sandbox.local import LocalEngine
from crr.tasks.schema import Task
task = Task(**json.loads(sys.argv[1]))
engine = LocalEngine(workdir=sys.argv[2])
sb = engine.start(task)
sb.exec("echo dirty > x.txt")
engine.restore(sb.snapshot())
print(engine.dir, flush=True)
if sys.argv[3] == "crash":
    threading.Thread(target=sb.exec, args=("sleep 105.7",), kwargs={"timeout": 100}, daemon=True).start()
    time.sleep(0.5)
    os._exit(1)  # no atexit, no finally: what a SIGKILL or power loss leaves behind
"""


def _run_owner(task, workdir: Path, how: str) -> Path:
    row = {k: v for k, v in task.__dict__.items() if k not in ("metadata", "extra")}
    out = subprocess.run([sys.executable, "-c", _CRASH, json.dumps(row), str(workdir), how],
                         capture_output=True, text=True, timeout=60, env=os.environ, check=False)
    assert out.returncode == (1 if how == "crash" else 0), out.stderr
    return Path(out.stdout.strip())


@pytest.mark.serial
@needs_root
def test_gc_leftovers_removes_crashed_engines_only(task, tmp_path):
    workdir = tmp_path / "sandboxes"
    dead = _run_owner(task, workdir, "crash")
    cgroup = Path("/sys/fs/cgroup/pids/crr") / dead.name
    memcg = _memory_cgroup_root() / dead.name
    # two sandboxes, each a tmpfs (its capped writable state) with the overlay in it
    assert dead.is_dir() and len(_mounts_under(dead)) == 4 and cgroup.is_dir() and memcg.is_dir()
    assert procs_with("sleep", "105.7")  # a command in flight outlived its owner
    with LocalEngine(workdir=workdir) as live, live.start(task) as sb:
        removed = gc_leftovers(workdir)
        assert str(dead) in removed and str(cgroup) in removed and str(memcg) in removed
        assert sum(r.startswith(str(dead)) and r.endswith("/tree") for r in removed) == 2
        assert not dead.exists() and not _mounts_under(dead) and not cgroup.exists() and not memcg.exists()
        assert procs_with("sleep", "105.7") == []
        assert sb.exec("echo still here").output == "still here\n"  # a live engine is not touched
        assert [r for r in gc_leftovers(workdir) if str(workdir) in r or live.dir.name in r] == []


@pytest.mark.serial
@needs_root
def test_gc_dry_run_lists_what_gc_removes_and_removes_nothing(task, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from crr.cli import app
    from crr.sandbox.local import reclaim

    workdir = tmp_path / "sandboxes"
    monkeypatch.setattr(reclaim, "default_workdir", lambda: workdir)  # where `crr sandbox gc` looks
    dead = _run_owner(task, workdir, "crash")
    mounts = _mounts_under(dead)

    def ours(items: list[str]) -> list[str]:
        return [r for r in items if dead.name in r]

    with LocalEngine(workdir=workdir) as live, live.start(task) as sb:
        listed = gc_leftovers(workdir, dry_run=True)
        assert str(dead) in listed and sum(r.endswith("/tree") for r in ours(listed)) == 2
        assert [r for r in listed if live.dir.name in r] == []
        result = CliRunner().invoke(app, ["sandbox", "gc", "--dry-run"])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert any(line.startswith("local: would remove ") for line in lines), result.output
        assert f"  {dead}" in lines, result.output
        assert dead.is_dir() and _mounts_under(dead) == mounts and procs_with("sleep", "105.7")  # all kept
        assert ours(gc_leftovers(workdir)) == ours(listed)
        assert not dead.exists() and procs_with("sleep", "105.7") == []
        assert sb.exec("echo still here").output == "still here\n"


@needs_root
def test_exit_without_close_leaves_nothing(task, tmp_path):
    owner_dir = _run_owner(task, tmp_path / "sandboxes", "exit")
    assert owner_dir.name.startswith("crr-engine-")
    assert not owner_dir.exists() and not _mounts_under(tmp_path)


@needs_root
def test_overlay_unavailable_falls_back_to_copies_once(task, tmp_path, caplog):
    base = tmp_path / "base"
    base.mkdir()
    with OverlayWorkspace(tmp_path / "ws", base) as ws:  # an upper dir cannot live on overlayfs
        with pytest.raises(SandboxError, match="overlayfs is unavailable"):
            LocalEngine(workdir=ws.tree / "sb", overlay=True)
        with caplog.at_level(logging.WARNING, logger="crr.sandbox.local"):
            engines = [LocalEngine(workdir=ws.tree / "sb") for _ in range(2)]
        assert [e.mode for e in engines] == ["copy", "copy"]
        assert sum("fall back to plain copies" in r.message for r in caplog.records) == 1
        with engines[0].start(task) as sb:
            assert sb.read_file("pkg/core.py").startswith(b"def f")
        for e in engines:
            e.close()


def test_commands_see_the_repository_at_a_fixed_path(engine, task):
    """No host path reaches an observation: the same state reads the same in every sandbox."""
    with engine.start(task) as a, engine.start(task) as b:
        outputs = [sb.exec('pwd; echo $TMPDIR; touch "$TMPDIR/scratch"; ls "$TMPDIR"').output for sb in (a, b)]
        assert outputs[0] == outputs[1] == "/testbed\n/tmp/crr-sandbox\nhome\nscratch\n"
        assert a.repo_dir == "/testbed"
        assert a.read_file("/testbed/pkg/core.py") == a.read_file("pkg/core.py")


def test_an_engine_that_cannot_contain_refuses_foreign_tasks(make_task, tmp_path, caplog, monkeypatch):
    """No sandbox root here (as on a host without the root filesystem, or not root): the engine says
    so when made, runs crr's own generated tasks, and refuses any other unless told to trust it."""
    foreign, own = make_task(FILES), make_task(FILES, instance_id="nano-1", repo="crr/nano")
    with caplog.at_level(logging.WARNING, logger="crr.sandbox.local"):
        eng = LocalEngine(workdir=tmp_path / "sb", rootfs=tmp_path / "no-root")
    with eng:
        assert "sandbox_root" in eng.uncontained and "cannot contain task code" in caplog.text
        with pytest.raises(CRRError, match="not one of crr's own.*--trust-task-code"):
            eng.start(foreign)
        with eng.start(own) as sb:
            assert sb.repo_dir != "/testbed" and sb.exec("echo ok").output == "ok\n"
    monkeypatch.setenv("CRR_TRUST_TASK_CODE", "1")  # what `crr --trust-task-code` sets
    opts = engine_spec("local").options
    assert opts == {"trust_task_code": True} and engine_spec("docker").options == {}
    with LocalEngine(workdir=tmp_path / "sb", rootfs=tmp_path / "no-root", **opts) as eng, eng.start(foreign) as sb:
        assert sb.exec("echo trusted").output == "trusted\n"
