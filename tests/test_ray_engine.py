"""The ray:local fork engine on a real two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on this
machine with their own resources): the same observations, forks and verdicts as the local engine, forks on
the parent's node, and a node that dies mid-episode is an infrastructure error, not a hang or a reward."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from agent_tasks import calc_task
from conftest import git_repo, procs_with

from crr.agent.tools import ToolCall, execute
from crr.agent.verifier import verify
from crr.bench.fork import ray_bench
from crr.errors import CRRError, SandboxError
from crr.sandbox import engines, get_engine
from crr.sandbox.base import ForkEngine, Sandbox, tree_digest
from crr.sandbox.local import gc_leftovers
from crr.sandbox.overlay import process_start
from crr.tasks.loaders import load_tasks
from crr.tasks.schema import Task

ray = pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")
# `cluster` (tests/conftest.py): a head and a worker raylet on this machine, two sandbox slots each

ROOT = Path(__file__).resolve().parents[1]
CALLS = [ToolCall("view_file", {"path": "calc.py"}),
         ToolCall("run_shell", {"command": "ls -la --time-style=+ . | awk '{print $1, $NF}'; pwd; echo $HOME"}),
         ToolCall("edit_file", {"path": "calc.py", "start": 2, "end": 2, "replacement": "    return a + b"}),
         ToolCall("run_shell", {"command": "git diff"}),
         ToolCall("view_file", {"path": "../etc/passwd"}),          # an error observation
         ToolCall("run_tests", {"test_filter": ""})]
EDITS = "echo new > new.txt && rm README.md && mkdir -p d/e && echo deep > d/e/f.py && chmod 755 calc.py"


@pytest.fixture(scope="module")
def engine(cluster):
    eng = get_engine("ray:local", address=cluster.address, cpus_per_sandbox=0.5)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def local():
    eng = get_engine("local")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def calc(tmp_path_factory) -> Task:
    root = tmp_path_factory.mktemp("ray-calc")

    def make(files: dict[str, str], instance_id: str = "t1", **fields) -> Task:
        repo = Path(tempfile.mkdtemp(dir=root, prefix=f"repo-{instance_id}-"))
        commit = git_repo(repo, files)
        return Task(**{"instance_id": instance_id, "repo": f"local/{instance_id}", "base_commit": commit,
                       "problem_statement": "", "patch": "", "test_patch": "", "FAIL_TO_PASS": (),
                       "PASS_TO_PASS": (), "version": "0", "repo_src": str(repo), **fields})

    return calc_task(make)


def test_ray_stays_out_of_light_imports():
    """Checking a ray: engine spec and `crr --help` import no ray: the factory defers it to `get_engine("ray:...")`."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom crr.cli import app\n"
            "from crr.sandbox import engine_spec\n"
            "assert engine_spec('ray:local', ray='auto').options == {'address': 'auto'}\n"
            "assert CliRunner().invoke(app, ['--help']).exit_code == 0\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_hosts_one_per_sandbox_node(engine, cluster):
    assert isinstance(engine, ForkEngine) and engine.name == "ray:local"
    hosts = engine.hosts()
    assert {h["node"] for h in hosts} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert all(h["capacity"] == 2 and h["dead"] is None and h["pid"] != os.getpid() for h in hosts)


def test_tool_calls_give_the_local_engines_observations(engine, local, calc):
    with local.start(calc) as here, engine.start(calc) as there:
        assert isinstance(there, Sandbox) and there.repo_dir == here.repo_dir
        for call in CALLS:
            want, got = execute(here, call), execute(there, call)
            assert got == want, call
        assert there.read_file("calc.py") == here.read_file("calc.py")
        there.write_file("x/y.txt", b"\x00bytes")
        assert there.exec("cat x/y.txt | od -c | head -1").output.split()[1:3] == ["\\0", "b"]
        with pytest.raises(CRRError, match="outside the repository"):
            there.read_file("../../etc/passwd")  # the host's error comes back as itself
        res = there.exec("sleep 5", timeout=0.5)
        assert res.timed_out and res.exit_code == 124


def test_starts_spread_and_forks_stay_on_the_parents_node(engine, local, calc):
    with local.start(calc) as ref:
        assert ref.exec(EDITS).exit_code == 0
        want = tree_digest(ref)
    parents = [engine.start(calc), engine.start(calc)]
    try:
        assert {p.node for p in parents} == {h["node"] for h in engine.hosts()}  # one on each node
        for parent in parents:
            assert parent.exec(EDITS).exit_code == 0
            snap = parent.snapshot()
            assert snap.engine == "ray:local" and snap.handle["node"] == parent.node
            forks = [engine.restore(snap), engine.restore(snap)]
            assert all(f.node == parent.node for f in forks)
            assert {tree_digest(f) for f in forks} == {tree_digest(parent)} == {want}
            forks[0].exec("echo mine > new.txt")
            assert parent.read_file("new.txt") == forks[1].read_file("new.txt") == b"new\n"
            for f in forks:
                f.close()
            engine.release(snap)
            with pytest.raises(CRRError, match="not held"):
                engine.restore(snap)
    finally:
        for p in parents:
            p.close()
    assert all(h["live"] == 0 for h in engine.hosts())


def test_gold_patch_scores_1_through_ray_as_locally(engine, local):
    tasks = load_tasks("nano-band")[:2]
    verdicts = {}
    for name, eng in (("local", local), ("ray", engine)):
        for task in tasks:
            with eng.start(task) as sb:
                sb.write_file("gold.patch", task.patch.encode())
                assert sb.exec("git apply gold.patch && rm gold.patch").exit_code == 0
                result = verify(sb, task, timeout=120)
            verdicts[name, task.instance_id] = (result.reward, result.infra_error, result.statuses)
    for task in tasks:
        assert verdicts["ray", task.instance_id] == verdicts["local", task.instance_id]
        assert verdicts["ray", task.instance_id][:2] == (1.0, None)


def test_the_determinism_filter_runs_unchanged_on_ray(cluster, tmp_path):
    """filter_tasks with engine ray:local (and a second, recording engine beside it, as --record-http makes):
    the shipped nano tasks are admitted, as on the local engine."""
    from crr.filter.determinism import ADMITTED, RESULTS, FilterConfig, filter_tasks
    from crr.rundir import RunDir

    tasks = load_tasks("nano-band")[:2]
    config = FilterConfig(engine="ray:local", engine_options={"address": cluster.address}, reruns=2, timeout=120,
                          record_http=True)
    run = RunDir.create("filter-tasks", "ray", root=tmp_path / "runs")
    summary = filter_tasks(tasks, run, config, workers=2)
    assert summary.admitted == 2 and summary.infra_errors == 0, run.records(RESULTS)
    assert {r["verdict"] for r in run.records(RESULTS)} == {ADMITTED}


def test_a_node_lost_mid_filter_is_an_infra_error_and_resume_finishes(cluster, tmp_path, monkeypatch):
    """Kill a node while the filter has a sandbox on it: that task is recorded as an infra error (never
    discarded: a lost node is not nondeterminism), the others are decided, and resuming decides it."""
    from crr.filter.determinism import ADMITTED, INFRA_ERROR, RESULTS, FilterConfig, filter_tasks
    from crr.rundir import RunDir

    victim = cluster.add_node(num_cpus=2, resources={"crr_sandbox": 4})  # the emptiest: sandboxes go there first
    cluster.wait_for_nodes()
    made = []
    make = engines.get_engine   # what the filter's EngineSpec.make calls
    monkeypatch.setattr(engines, "get_engine", lambda name, **opts: made.append(make(name, **opts)) or made[-1])

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            hosts = [h for eng in made for h in eng.hosts() if h["node"] == victim.node_id]
            if any(h["live"] for h in hosts):
                cluster.remove_node(victim)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    tasks = load_tasks("nano-band")[:3]
    config = FilterConfig(engine="ray:local", engine_options={"address": cluster.address, "cpus_per_sandbox": 0.5},
                          reruns=2, timeout=120)
    run = RunDir.create("filter-tasks", "ray-kill", root=tmp_path / "runs")
    try:
        first = filter_tasks(tasks, run, config, workers=2)
    finally:
        killer.join()
    verdicts = [r["verdict"] for r in run.records(RESULTS)]
    assert victim.node_id not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}, "the victim was never busy"
    assert first.infra_errors >= 1 and set(verdicts) <= {ADMITTED, INFRA_ERROR}, run.records(RESULTS)
    again = filter_tasks(tasks, run, config, workers=2)  # resume: infra errors are tried again
    assert again.admitted == 3 and again.infra_errors == 0


def test_ray_bench_times_both_engines_in_one_run(cluster):
    r = ray_bench(cluster.address, n_files=20, repeats=2)
    assert r["nodes"] == 2 and r["direct"].keys() == r["ray"].keys()
    for key in ("exec", "read", "fork"):
        for label in ("direct", "ray"):
            assert 0 < r[label][f"{key}_ms_p50"] <= r[label][f"{key}_ms_p95"]
        assert r[f"{key}_overhead_ms_p50"] == pytest.approx(r["ray"][f"{key}_ms_p50"] - r["direct"][f"{key}_ms_p50"])
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("crr-fork-bench-")]


@pytest.mark.serial
def test_a_node_lost_mid_episode_is_an_infra_failure(cluster, calc):
    """Kill the node of an episode's sandbox while it runs a command: the episode ends as an infrastructure
    failure (reward None, never 0) within seconds, its snapshots' restores raise SandboxError, new sandboxes
    go to the nodes still alive, and what the dead host left on this machine is ordinary local-engine
    leftovers, which gc_leftovers (`crr sandbox gc`) reclaims."""
    from transformers import AutoTokenizer

    from crr.agent.conversation import action_text
    from crr.agent.episode import Episode, EpisodeConfig
    from crr.policy.model import SHIPPED_DEFAULT

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_DEFAULT)
    victim = cluster.add_node(num_cpus=1, resources={"crr_sandbox": 1})
    cluster.wait_for_nodes()
    eng = get_engine("ray:local", address=cluster.address, cpus_per_sandbox=0.5, exec_margin_s=10)
    try:
        host = next(h for h in eng.hosts() if h["node"] == victim.node_id)
        episodes = []
        for _ in range(3):  # spread: one sandbox on each of the three nodes
            episodes.append(Episode(calc, eng, tokenizer, EpisodeConfig(max_turns=5)))
            episodes[-1].start()
        episode = next(e for e in episodes if e.sandbox.node == victim.node_id)
        assert episode.act(action_text(ToolCall("view_file", {"path": "calc.py"}))) is not None
        snap = episode.sandbox.snapshot()
        ended: list = []
        mid = threading.Thread(target=lambda: ended.append(
            episode.act(action_text(ToolCall("run_shell", {"command": "sleep 37.25"})))))
        mid.start()
        time.sleep(1.0)  # the command is running on the victim
        t0 = time.monotonic()
        cluster.remove_node(victim)
        mid.join(30)
        assert not mid.is_alive() and time.monotonic() - t0 < 30 and ended == [None] and episode.done
        traj = episode.finish()
        assert traj.reward is None and traj.end_reason == "infra_error" and "died" in traj.infra_error
        with pytest.raises(SandboxError, match="gone"):
            eng.restore(snap)
        eng.release(snap)  # nothing to free: no error
        traj.release()
        with eng.start(calc) as again:  # new sandboxes avoid the dead node
            assert again.node != victim.node_id and again.exec("true").exit_code == 0
        assert next(h for h in eng.hosts() if h["node"] == victim.node_id)["dead"]
        for e in episodes:
            if e is not episode:
                e.sandbox.close()
                e.traj.release()
    finally:
        eng.close()
    deadline = time.monotonic() + 20
    while process_start(host["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_start(host["pid"]), "the dead node's sandbox host process lives on"
    left = Path(host["engine_dir"]).exists()  # SIGKILLed with its raylet: its engine never closed
    removed = gc_leftovers()  # what `crr sandbox gc` runs on this machine
    assert not Path(host["engine_dir"]).exists() and (not left or host["engine_dir"] in removed)
    assert not procs_with("sleep", "37.25")
