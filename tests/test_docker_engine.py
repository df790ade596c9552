"""The Docker fork engine (commit and overlay modes) and sandbox gc, on a real daemon, real images,
real git repositories and real mounts: what is its own (images, labels, lock-down, the pool, flattening, gc).
What every engine does: test_engine_contract.py. Skipped only when no Docker daemon answers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import docker
import pytest
from typer.testing import CliRunner

from crr.errors import CRRError, SandboxError
from crr.sandbox.base import tree_digest
from crr.sandbox.checkout import cache_root
from crr.sandbox.docker import DEFAULT_BASE_IMAGE, TESTBED_ENV, DockerEngine, docker_client, gc

pytestmark = pytest.mark.docker

FILES = {"README.md": "hello\n", "pkg/__init__.py": "", "pkg/core.py": "def f():\n    return 1\n",
         "pkg/sub/deep.py": "X = 1\n", "run.sh": "#!/bin/sh\necho run\n", "gone/a.txt": "a\n"}


@pytest.fixture(scope="module")
def client():
    try:
        client = docker_client()
    except SandboxError as e:
        pytest.skip(str(e))
    yield client
    # Task images are a cache keyed by commit; drop the ones these tests built.
    for im in client.api.images(filters={"label": "org.crr.role=task"}):
        if (im.get("Labels") or {}).get("org.crr.task", "").startswith("dk-"):
            for tag in im.get("RepoTags") or []:
                try:
                    client.api.remove_image(tag)
                except docker.errors.APIError:  # in use by a run that shares the commit: it stays
                    pass


@pytest.fixture(scope="module")
def api(client):
    return client.api


@pytest.fixture(scope="module", params=["commit", "overlay"])
def engine(request, api):
    eng = DockerEngine(mode=request.param)
    yield eng
    eng.close()


@pytest.fixture
def task(make_task):
    return make_task(FILES, instance_id="dk-t")





def test_task_given_as_image(engine, api, task):
    """A task with an image and no repo_src (SWE-bench style: the repository at /testbed)."""
    with DockerEngine(mode="commit") as builder, builder.start(task) as sb:
        image = sb.image  # crr-task:<key>: the base image plus the repository
        want = tree_digest(sb)
    image_task = dataclasses.replace(task, instance_id="dk-image", image=image, repo_src=None)
    with engine.start(image_task) as sb:
        assert tree_digest(sb) == want
        assert sb.exec("git log --format=%H -1").output.strip() == task.base_commit


def test_commands_in_a_swebench_style_image_use_its_testbed_env(engine, task):
    """SWE-bench images keep python and the project's deps in conda's `testbed` env, which nothing activates
    for non-interactive shells: the agent's commands must find it first on PATH all the same."""
    with DockerEngine(mode="commit") as builder, builder.start(task) as sb:
        python = f"{TESTBED_ENV}/bin/python"
        assert sb.exec(f"mkdir -p {TESTBED_ENV}/bin && printf '#!/bin/sh\\necho testbed python\\n' > {python} "
                       f"&& chmod +x {python}").exit_code == 0
        snap = sb.snapshot()  # commit mode: an image of the whole container, /opt included
        image_task = dataclasses.replace(task, instance_id="dk-conda", image=snap.handle["image"], repo_src=None)
        with engine.start(image_task) as conda_sb:
            assert conda_sb.exec("python --version").output == "testbed python\n"
            assert conda_sb.exec("echo $CONDA_DEFAULT_ENV").output == "testbed\n"
        builder.release(snap)
    with engine.start(task) as plain:  # an image without the env is untouched
        assert "Python 3" in plain.exec("python --version").output


def test_missing_image_is_a_clear_error(engine, task):
    with pytest.raises(SandboxError, match="never pulls"):
        engine.start(dataclasses.replace(task, image="crr-no-such-image:1"))
    with DockerEngine(mode=engine.mode, image="crr-no-such-base:1") as other, \
            pytest.raises(SandboxError, match="build-base-image.sh"):
        other.start(task)





def test_container_is_locked_down_and_edits_keep_modes(engine, api, task):
    with engine.start(task) as sb:
        res = sb.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"",
                      timeout=30)
        assert res.exit_code != 0 and "unreachable" in res.output
        assert "eth0" not in sb.exec("cat /proc/net/dev").output
        attrs = api.inspect_container(sb.box.id)
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none" and host["PidsLimit"] == 512
        assert host["Memory"] == 2 * 1024 ** 3 and host["NanoCpus"] == 10 ** 9
        assert host["LogConfig"] == {"Type": "json-file", "Config": {"max-size": "1m", "max-file": "1"}}
        assert host["ReadonlyRootfs"] == (engine.mode == "overlay")  # commit: the layer is watched instead
        assert bool(sb.box.watch) == (engine.mode == "commit")
        labels = attrs["Config"]["Labels"]
        assert labels["org.crr.owner"] == "crr" and labels["org.crr.engine"] == engine.id
        assert labels["org.crr.pid"] == str(os.getpid())
        with pytest.raises(CRRError, match="directory"):   # (paths outside the repository: the contract suite)
            sb.read_file("pkg")
        sb.exec("chmod 755 run.sh")
        sb.write_file("run.sh", b"#!/bin/sh\necho edited\n")  # an edit keeps the mode
        assert sb.exec("./run.sh").output == "edited\n"


def test_dead_container_is_a_sandbox_error(engine, api, task):
    sb = engine.start(task)
    api.kill(sb.box.id)
    with pytest.raises(SandboxError, match=f"{sb.name} of task dk-t is gone"):
        sb.exec("true")
    sb.close()

    sb = engine.start(task)
    threading.Timer(1.0, lambda: api.remove_container(sb.box.id, force=True)).start()
    start = time.monotonic()
    with pytest.raises(SandboxError, match="gone"):
        sb.exec("sleep 60", timeout=120)
    assert time.monotonic() - start < 15
    if engine.mode == "commit":  # (an overlay snapshot reads only the host workspace, which is intact)
        with pytest.raises(SandboxError, match="gone"):
            sb.snapshot()
    sb.close()


def test_wedged_container_cannot_hang_an_action(engine, api, task, monkeypatch):
    monkeypatch.setattr("crr.sandbox.docker.sandbox._GRACE_S", 1.0)
    with engine.start(task) as sb:
        api.pause(sb.box.id)  # a frozen PID 1 never runs the action, and kill cannot reach it
        try:
            start = time.monotonic()
            with pytest.raises(SandboxError, match=sb.name):
                sb.exec("true", timeout=1)
            assert time.monotonic() - start < 10
        finally:
            api.unpause(sb.box.id)
        assert sb.exec("echo alive").output == "alive\n"  # the stale request did no harm


def test_released_snapshot_goes_when_its_last_fork_closes(engine, api, task):
    with engine.start(task) as sb:
        snap = sb.snapshot()
        fork = engine.restore(snap)
        engine.release(snap)
        with pytest.raises(CRRError, match="not held"):
            engine.restore(snap)
        if engine.mode == "commit":
            api.inspect_image(snap.handle["image"])  # still there: the fork came from it
            fork.close()
            with pytest.raises(docker.errors.ImageNotFound):
                api.inspect_image(snap.handle["image"])
        else:
            assert Path(snap.handle["layer"]).is_dir()
            fork.close()
            assert not Path(snap.handle["layer"]).exists()


@pytest.mark.slow  # two export/import flattens of the ~300 MB base image: ~30 s on 2 busy cores
def test_commit_chain_is_flattened(api, task):
    """Fork of a fork of ... in commit mode, past the layer limit (here flatten_depth=3)."""
    with DockerEngine(mode="commit", flatten_depth=3) as eng:
        sb, depths = eng.start(task), []
        for gen in range(6):
            sb.exec(f"echo {gen} > gen{gen}")
            want = tree_digest(sb)
            snap = sb.snapshot()
            depths.append(snap.handle["depth"])
            assert len(api.inspect_image(snap.handle["image"])["RootFS"]["Layers"]) == depths[-1] <= 3
            sb.close()
            sb = eng.restore(snap)
            eng.release(snap)  # the image stays while `sb` runs on it
            assert tree_digest(sb) == want
        assert 1 in depths  # flattened at least once
        res = sb.exec("cat gen*; pwd; echo $PATH")
        assert res.output.split("\n")[:7] == ["0", "1", "2", "3", "4", "5", "/testbed"]
        assert "/usr/bin" in res.output
        sb.close()
        assert api.images(filters={"label": [f"org.crr.engine={eng.id}", "org.crr.role=snapshot"]}) == []


def test_overlay_pool_reuses_only_clean_containers(api, task):
    with DockerEngine(mode="overlay", pool_size=1) as eng:
        def settle():  # let the pool's background starts and recycles finish
            eng._background.submit(lambda: None).result()

        # Each kind of writable place outside /testbed of the read-only root (the scratch tmpfs at /tmp, HOME
        # and /var/tmp; Docker's /dev; the command channel): dirtied, the container is removed, not pooled.
        for dirt in ("echo dirty > ~/.dirty", "echo dirty > /dev/dirty", "echo dirty > /run/crr/dirty"):
            b = eng.start(task)
            assert b.exec(dirt).exit_code == 0
            b_id = b.box.id
            b.close()
            settle()
            assert not api.containers(all=True, filters={"id": b_id}), f"dirty ({dirt}) went back to the pool"
        a = eng.start(task)
        a_name, fresh = a.name, tree_digest(a)
        a.exec("echo scratch > in_repo.txt")  # /testbed is the workspace's, not the container's
        settle()
        a.close()
        settle()  # the pool: [a spare container, a]
        with eng.start(task), eng.start(task) as c:
            assert c.name == a_name  # the clean one came back
            assert tree_digest(c) == fresh and c.exec("test -e in_repo.txt").exit_code == 1


@pytest.mark.parametrize("mode", ["commit", "overlay"])
def test_close_leaves_nothing_behind(api, task, mode):
    eng = DockerEngine(mode=mode)
    sb = eng.start(task)
    sb.exec("echo x > f && sleep 300 &")
    snap = sb.snapshot()
    fork = eng.restore(snap)
    fork.snapshot()  # left unreleased, like `fork`, `sb` and `snap`
    root = eng.root
    eng.close()
    label = f"org.crr.engine={eng.id}"
    assert api.containers(all=True, filters={"label": label}) == []
    assert api.images(all=True, filters={"label": [label, "org.crr.role=snapshot"]}) == []
    assert not root.exists()
    with open("/proc/self/mountinfo") as f:
        assert str(root) not in f.read()
    eng.close()  # idempotent
    with pytest.raises(CRRError, match="closed"):
        eng.start(task)


@pytest.mark.serial
def test_gc_removes_only_crashed_runs(client, task):
    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = {"org.crr.owner": "crr", "org.crr.role": "sandbox", "org.crr.engine": "gctest",
             "org.crr.host": socket.gethostname()}
    tag = uuid.uuid4().hex[:8]
    crashed = client.containers.create(DEFAULT_BASE_IMAGE, entrypoint=["true"], name=f"crr-gc-crashed-{tag}",
                                       labels={**owner, "org.crr.pid": str(gone.pid), "org.crr.pidstart": "1"})
    live = client.containers.create(DEFAULT_BASE_IMAGE, entrypoint=["true"], name=f"crr-gc-live-{tag}",
                                    labels={**owner, "org.crr.pid": str(os.getpid())})
    foreign = client.containers.create(DEFAULT_BASE_IMAGE, entrypoint=["true"], name=f"not-crr-{tag}",
                                       labels={"org.example.owner": "someone"})
    # A crashed overlay-mode engine's host dir, with a mount left in it.
    root = cache_root() / "docker" / f"crr-docker-{gone.pid}-gctest{tag}"
    (root / "slots" / "s").mkdir(parents=True)
    (root / "owner.json").write_text(json.dumps({**owner, "org.crr.pid": str(gone.pid)}))
    subprocess.run(["mount", "--bind", str(root / "slots" / "s"), str(root / "slots" / "s")], check=True)
    try:
        preview = gc(dry_run=True)
        assert f"container crr-gc-crashed-{tag}" in preview and f"dir {root}" in preview
        crashed.reload()  # still there
        removed = gc()
        assert f"container crr-gc-crashed-{tag}" in removed and f"mount {root}/slots/s" in removed
        with pytest.raises(docker.errors.NotFound):
            crashed.reload()
        live.reload()
        foreign.reload()
        assert not root.exists()
        assert not any(f"crr-gc-live-{tag}" in r or f"not-crr-{tag}" in r for r in removed)
        with DockerEngine(mode="commit") as eng, eng.start(task):
            pass  # makes sure a task image exists
        assert any(r.startswith("image crr-task:") for r in gc(all=True, dry_run=True))
    finally:
        for c in (crashed, live, foreign):
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
        subprocess.run(["umount", "-l", str(root / "slots" / "s")], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


_RUN_AND_DIE = """
import os, sys, json
from crr.sandbox.docker import DockerEngine
from crr.tasks.schema import Task
task = Task(**json.loads(sys.argv[1]))
engine = DockerEngine(mode="overlay")
sb = engine.start(task)
sb.snapshot()
print(json.dumps({"engine": engine.id, "root": str(engine.root)}), flush=True)
if sys.argv[2] == "interrupt":
    raise KeyboardInterrupt
os.kill(os.getpid(), 9)
"""


@pytest.mark.serial
@pytest.mark.parametrize("death", ["interrupt", "kill"])
def test_an_interrupted_run_cleans_up_and_a_killed_one_is_collected(api, task, death):
    row = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
    proc = subprocess.run([sys.executable, "-c", _RUN_AND_DIE, json.dumps(row), death],
                          capture_output=True, text=True, timeout=120, check=False)
    info = json.loads(proc.stdout.splitlines()[0])
    label = f"org.crr.engine={info['engine']}"
    with open("/proc/self/mountinfo") as f:
        left = info["root"] in f.read()
    if death == "interrupt":  # atexit closed the engine
        assert "KeyboardInterrupt" in proc.stderr
        assert api.containers(all=True, filters={"label": label}) == [] and not left
        assert not Path(info["root"]).exists()
        return
    assert api.containers(all=True, filters={"label": label}) and left  # SIGKILL: all left behind
    # The engine warms pool containers in a background thread: a create the daemon accepted before the
    # SIGKILL can still land after it. Collect once docker has settled (gc run again would find it too).
    ids, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = {c["Id"] for c in api.containers(all=True, filters={"label": label})}
        if now == ids:
            break
        ids = now
        time.sleep(1.0)
    removed = gc()
    assert any(r.startswith("container crr-" + info["engine"]) for r in removed)
    assert api.containers(all=True, filters={"label": label}) == []
    with open("/proc/self/mountinfo") as f:
        assert info["root"] not in f.read()
    assert not Path(info["root"]).exists()


def test_cli_sandbox_gc_dry_run(api):
    from crr.cli import app

    res = CliRunner().invoke(app, ["sandbox", "gc", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "docker" in res.output and "local" in res.output
