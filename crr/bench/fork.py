"""Fork latency benchmark (paper: Appendix "Rollout-Dispatch Cost Breakdown": counterfactual
fork/materialisation is the largest single CRR overhead, 36.2 s per 256 forks, ~141 ms a fork).

A synthetic repository (n_files files of 1-8 KB in ~50 dirs) is started in a sandbox and edited
a little, as an agent would; then snapshot, restore and fork (snapshot + restore + one trivial
command in the fork) are timed over `repeats`. Generic over the ForkEngine protocol.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from crr.errors import CRRError, SandboxError
from crr.sandbox import RAY_PREFIX, engine_spec, get_engine
from crr.sandbox.base import tree_digest
from crr.sandbox.checkout import base_checkout
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

MODES = {"local": ("overlay", "copy"), "docker": ("overlay", "commit")}  # "both" compares the two
_GIT_ENV = {"GIT_AUTHOR_NAME": "crr", "GIT_AUTHOR_EMAIL": "bench@crr.invalid", "GIT_COMMITTER_NAME": "crr",
            "GIT_COMMITTER_EMAIL": "bench@crr.invalid", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}


def fork_bench(engine_name: str, mode: str | None = None, n_files: int = 5000, n_edited: int = 7,
               repeats: int = 20, ray: str | None = None, options: dict | None = None) -> dict:
    """p50/p95 latencies (ms) of snapshot, restore and fork, and whether a fork is exact.

    mode: the engine's mode (local: overlay|copy, docker: overlay|commit; ray:local and ray:docker: their
    inner engine's), None for its default, or "both" to measure the two and add e.g.
    `commit_over_overlay_fork_ratio`. ray: a ray:... engine's cluster address (None: auto). options: the
    engine's other options (crr.sandbox.engines).
    """
    inner = engine_name.removeprefix(RAY_PREFIX)
    engine_spec(engine_name, options, ray=ray)  # an unknown engine or option fails before any work
    if inner not in MODES and mode is not None:
        raise CRRError(f"engine {engine_name} has no modes (local and docker have); drop --mode, got {mode!r}")
    if inner in MODES and mode not in (None, "both", *MODES[inner]):
        raise CRRError(f"engine {engine_name} has modes {', '.join(MODES[inner])} (or both); "
                       f"got {mode!r}")
    if n_files < 10 or repeats < 1:
        raise CRRError("the fork benchmark needs at least 10 files and 1 repeat")
    with tempfile.TemporaryDirectory(prefix="crr-fork-bench-") as tmp:
        task = synthetic_task(Path(tmp) / "repo", n_files)
        checkout = base_checkout(task)  # made here so that no timing includes the clone
        os.sync()  # and so that writing back the fresh trees to disk does not land in the timings
        try:
            if mode != "both":
                return _measure(engine_name, mode, task, n_files, n_edited, repeats, ray, options)
            a, b = MODES[inner]
            runs = {m: _measure(engine_name, m, task, n_files, n_edited, repeats, ray, options) for m in (a, b)}
            return {"engine": engine_name, "mode": "both", "n_files": n_files, "repeats": repeats,
                    "modes": runs,
                    f"{b}_over_{a}_fork_ratio": runs[b]["fork_ms_p50"] / runs[a]["fork_ms_p50"]}
        finally:
            shutil.rmtree(checkout, ignore_errors=True)


def synthetic_task(path: Path, n_files: int, seed: int = 0) -> Task:
    """A committed git repository of `n_files` files (1-8 KB) in ~50 dirs, as a Task."""
    rng = random.Random(seed)
    for i in range(n_files):
        f = path / _file_name(i, n_files)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(rng.randbytes(rng.randint(512, 4096)).hex().encode())  # 1-8 KB of text
    commit = commit_all(path)
    return Task(instance_id=f"fork-bench-{n_files}", repo="synthetic/fork-bench", base_commit=commit,
                problem_statement="", patch="", test_patch="", FAIL_TO_PASS=(), PASS_TO_PASS=(),
                version="0", repo_src=str(path))


def commit_all(path: Path, message: str = "base") -> str:
    """`git init` at `path` (made if missing), commit everything in it reproducibly; the commit sha."""
    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **_GIT_ENV}
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", message]):
        subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _file_name(i: int, n_files: int) -> str:
    return f"pkg_{i % max(1, min(50, n_files // 20)):02d}/mod_{i:05d}.py"


def _edit_script(n_files: int, n_edited: int) -> str:
    """Modify n_edited - 2 files, add 2 (one in a new dir), delete 1, chmod 1: an agent's few edits."""
    lines = [f"printf 'edit {i}\\n' >> {_file_name(i, n_files)}" for i in range(max(n_edited - 2, 0))]
    lines += ["mkdir -p added && printf 'new\\n' > added/new_a.py",
              "printf 'new\\n' > pkg_00/new_b.py"][:n_edited]
    lines += [f"rm {_file_name(n_files - 1, n_files)}", f"chmod 755 {_file_name(n_files - 2, n_files)}"]
    return " && ".join(lines)


def _measure(engine_name: str, mode: str | None, task: Task, n_files: int, n_edited: int,
             repeats: int, ray: str | None = None, options: dict | None = None) -> dict:
    local = engine_name.removeprefix(RAY_PREFIX) == "local"   # the local engine's modes: overlay=True|False
    opts = dict(engine_spec(engine_name, options, ray=ray, mode=None if local else mode).options)
    if local and mode is not None:
        opts["overlay"] = mode == "overlay"
    engine = get_engine(engine_name, **opts)
    try:
        with engine.start(task) as parent:
            res = parent.exec(_edit_script(n_files, n_edited), timeout=60)
            if res.exit_code != 0:
                raise SandboxError(f"fork bench: editing the synthetic repo failed: {res.output[-300:]}")
            want = tree_digest(parent)
            snap_ms, restore_ms, fork_ms = [], [], []
            for i in range(repeats + 1):  # round 0 warms caches and checks exactness, untimed
                t0 = time.perf_counter()
                snap = parent.snapshot()
                t1 = time.perf_counter()
                fork = engine.restore(snap)
                t2 = time.perf_counter()
                ran = fork.exec("true", timeout=60)
                t3 = time.perf_counter()
                if ran.exit_code != 0:
                    raise SandboxError(f"fork bench: `true` failed in a fork: {ran.output[-300:]}")
                if i == 0:
                    exact = tree_digest(fork) == want
                else:
                    snap_ms.append((t1 - t0) * 1e3)
                    restore_ms.append((t2 - t1) * 1e3)
                    fork_ms.append((t3 - t0) * 1e3)
                fork.close()
                engine.release(snap)
    finally:
        engine.close()
    out = {"engine": engine_name, "mode": getattr(engine, "mode", mode), "n_files": n_files,
           "n_edited": n_edited, "repeats": repeats, "exact": exact}
    for key, xs in (("snapshot", snap_ms), ("restore", restore_ms), ("fork", fork_ms)):
        out[f"{key}_ms_p50"] = round(float(np.percentile(xs, 50)), 3)
        out[f"{key}_ms_p95"] = round(float(np.percentile(xs, 95)), 3)
    log.info("fork bench %s/%s: fork p50 %.1f ms", engine_name, out["mode"], out["fork_ms_p50"])
    return out


def ray_bench(address: str | None = None, inner: str = "local", n_files: int = 1000, repeats: int = 50,
              nodes: int = 2) -> dict:
    """Tool-call and fork latency p50/p95 (ms) through `ray:<inner>` against `<inner>` directly, in one run.

    Per round, on one sandbox of each engine (rounds alternate between the two, so that load on the
    machine falls on both alike): `exec` (a shell tool call: `true`), `read` (a view tool call: read_file
    of a small file) and `fork` (snapshot + restore + `true` in the fork, as fork_bench). address: a Ray
    cluster's address; None starts a throwaway ray.cluster_utils.Cluster of `nodes` raylets on this
    machine (one CPU and two sandbox slots each) and shuts it down after, so the difference is Ray's own
    dispatch cost (driver -> host actor -> the same local engine), with no network in it.
    """
    # deferred: ray is the optional `ray` extra, and `crr fork bench` imports this module without needing it
    import ray

    if repeats < 1 or n_files < 10:
        raise CRRError("the ray benchmark needs at least 10 files and 1 repeat")
    with local_cluster(nodes, address=address) as connected:
        with tempfile.TemporaryDirectory(prefix="crr-fork-bench-") as tmp:
            task = synthetic_task(Path(tmp) / "repo", n_files)
            checkout = base_checkout(task)
            engines = {}
            try:
                engines["direct"] = get_engine(inner)
                engines["ray"] = engine_spec(f"ray:{inner}", ray=connected).make()
                times = _call_latencies(engines, task, n_files, repeats)
            finally:
                for engine in engines.values():
                    engine.close()
                shutil.rmtree(checkout, ignore_errors=True)
        out = {"inner": inner, "n_files": n_files, "repeats": repeats, "address": connected,
               "nodes": sum(n["Alive"] for n in ray.nodes()), "direct": {}, "ray": {}}
    for label, per_key in times.items():
        for key, xs in per_key.items():
            out[label][f"{key}_ms_p50"] = round(float(np.percentile(xs, 50)), 3)
            out[label][f"{key}_ms_p95"] = round(float(np.percentile(xs, 95)), 3)
    for key in ("exec", "read", "fork"):
        out[f"{key}_overhead_ms_p50"] = round(out["ray"][f"{key}_ms_p50"] - out["direct"][f"{key}_ms_p50"], 3)
    return out


@contextlib.contextmanager
def local_cluster(nodes: int, cpus: int = 1, slots: int = 2, address: str | None = None) -> Iterator[str]:
    """This process connected to Ray; yields the address. With `nodes` > 0 (and no `address`): a throwaway
    ray.cluster_utils.Cluster of that many raylets on this machine, each with `cpus` CPUs and `slots`
    `crr_sandbox` slots, shut down (and its session logs removed) after; else the cluster at `address`."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    if address is None and nodes > 0:
        args = {"num_cpus": cpus, "resources": {"crr_sandbox": slots}}
        cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(**args)
        address = cluster.address
    try:
        if not ray.is_initialized():
            ray.init(address=address, configure_logging=False)
        if cluster is not None:
            cluster.wait_for_nodes()
        yield address
    finally:
        if cluster is not None:
            session = cluster.head_node.get_session_dir_path()
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(session, ignore_errors=True)  # the throwaway cluster's logs


def _call_latencies(engines: dict, task: Task, n_files: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{engine label: {exec|read|fork: [ms per round]}}, the engines' rounds interleaved."""
    times = {label: {"exec": [], "read": [], "fork": []} for label in engines}
    sandboxes = {label: engine.start(task) for label, engine in engines.items()}
    path = _file_name(0, n_files)
    try:
        for sb in sandboxes.values():
            if sb.exec(_edit_script(n_files, 7), timeout=60).exit_code != 0:
                raise SandboxError("ray bench: editing the synthetic repo failed")
        for i in range(repeats + 1):  # round 0 warms up, untimed
            for label, sb in sandboxes.items():
                engine = engines[label]
                t0 = time.perf_counter()
                if sb.exec("true", timeout=60).exit_code != 0:
                    raise SandboxError("ray bench: `true` failed")
                t1 = time.perf_counter()
                sb.read_file(path)
                t2 = time.perf_counter()
                snap = sb.snapshot()
                fork = engine.restore(snap)
                fork.exec("true", timeout=60)
                t3 = time.perf_counter()
                fork.close()
                engine.release(snap)
                if i:
                    times[label]["exec"].append((t1 - t0) * 1e3)
                    times[label]["read"].append((t2 - t1) * 1e3)
                    times[label]["fork"].append((t3 - t2) * 1e3)
    finally:
        for sb in sandboxes.values():
            sb.close()
    return times
