"""Fault injection on real `crr` processes (tests/test_interrupt.py, research/interrupt_figures.py): signal one
mid-run, then find what of it survives: its processes, containers, snapshot images, engine directories, mounts."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from crr.errors import SandboxError
from crr.sandbox.checkout import cache_root
from crr.sandbox.docker.common import PID, ROLE, docker_client
from crr.sandbox.overlay import process_start

ENGINES = {"local": (), "docker": ("--engine", "docker", "--mode", "overlay")}  # filter-tasks options


def descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below `pid` now."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        found |= frontier
    return {(p, start) for p in found if (start := process_start(p))}


def leftovers(pid: int) -> list[str]:
    """Containers, snapshot images, engine directories, mounts and pids cgroups that process `pid` made and left."""
    cache = cache_root()
    dirs = [*cache.glob(f"sandboxes/crr-engine-{pid}-*"), *cache.glob(f"docker/crr-docker-{pid}-*")]
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if any(str(d) in line for d in dirs)]
    things = [f"dir {d}" for d in dirs] + [f"mount {m}" for m in mounts]
    things += [f"cgroup {c}" for c in Path("/sys/fs/cgroup/pids/crr").glob(f"crr-engine-{pid}-*")]
    try:
        api = docker_client().api
    except SandboxError:  # no Docker daemon: nothing of Docker's to leave
        return things
    things += [f"container {c['Names'][0]}" for c in api.containers(all=True, filters={"label": f"{PID}={pid}"})]
    things += [f"image {i['Id']}" for i in api.images(all=True, filters={"label": f"{PID}={pid}"})
               if i["Labels"].get(ROLE) != "task"]  # per-task images are a cache keyed by commit, kept
    return things


def wait_for_records(path_glob: str, root: Path, proc: subprocess.Popen, n: int = 1, limit_s: float = 240) -> Path:
    """The results.jsonl under `root` once it holds `n` records (the run is then mid-way)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for path in root.glob(path_glob):
            if len(path.read_text().splitlines()) >= n:
                return path.parent
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no {n} records under {root} within {limit_s} s")


def interrupt(proc: subprocess.Popen, sig: int) -> tuple[set, str]:
    """Send `sig` mid-run; (its processes when signalled, its stderr) once it is gone."""
    kids = descendants(proc.pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return kids, err


def survivors(kids: set[tuple[int, str]]) -> list[int]:
    return [pid for pid, start in kids if process_start(pid) == start]
