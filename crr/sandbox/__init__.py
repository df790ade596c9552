"""The sandbox layer: sandboxes, fork engines and the snapshot/fork protocol (crr.sandbox.base), their gc,
base checkouts, package mirrors and HTTP record/replay.

HTTP record/replay (http.py, and http_plugin.py that runs inside a sandbox) lives here too, not in a
`replay/` of its own: it is a door of the sandbox (a cassette installed into a sandbox, read by a plugin
inside it, set up by mirror.py), and "replay" in crr's other names (`replay_at`, `crr replay verify`,
train/replay_noise.py) means re-running an episode's actions, which belongs to the agent and train layers.

Engines are chosen by name: `get_engine("local")`, `get_engine("docker", mode=...)`,
`get_engine("ray:local", address="auto")` (sandboxes on a Ray cluster's nodes, crr.sandbox.ray_engine).

A fork engine (the ForkEngine protocol of crr.sandbox.base) is registered under a name with a factory that
takes the engine's options; a new one is

    register_engine("firecracker", FirecrackerEngine)      # get_engine("firecracker", **opts) -> FirecrackerEngine(**opts)

Commands and configs name an engine with a few settings (`--engine`, `--ray`, `--mode`, or the same config
keys); `engine_options` is the one place that turns them into get_engine's options, and `engine_workers`
sizes a driver's worker threads to the engine (a Ray engine's sandbox slots):

    engine = get_engine(name, **engine_options(name, ray=address, mode=mode))
    workers = engine_workers(engine, workers, default=4)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from crr.errors import CRRError, SandboxError
from crr.sandbox.base import ForkEngine

log = logging.getLogger(__name__)


def _local(**opts) -> ForkEngine:
    from crr.sandbox.local import LocalEngine  # deferred: ~50 ms of imports that naming an engine need not pay

    return LocalEngine(**opts)


def _docker(**opts) -> ForkEngine:
    from crr.sandbox.docker import DockerEngine  # deferred: it pulls in the Docker SDK

    return DockerEngine(**opts)


def _on_ray(inner: str) -> Callable[..., ForkEngine]:
    """The factory of `ray:<inner>`: sandboxes on a Ray cluster's nodes, each node running `inner`
    (crr.sandbox.ray_engine). Options: address ("auto", as ray.init takes it; "local": a one-node Ray on
    this machine), cpus_per_sandbox, resource, timeouts; the rest go to the inner engine on every node."""

    def make(**opts) -> ForkEngine:
        # deferred: importing ray costs ~0.3 s (more on a busy machine) that `crr --help` and the light
        # commands need not pay; only an engine named ray:... does (ray is the optional `ray` extra).
        try:
            from crr.sandbox.ray_engine import RayEngine
        except ImportError as e:
            raise CRRError(f"engine ray:{inner} needs Ray: pip install -e '.[ray]' ({e})") from None
        return RayEngine(inner, factory=ENGINES[inner], **opts)

    return make


RAY_PREFIX = "ray:"                      # ray:<inner engine>: sandboxes on a Ray cluster's nodes
DOCKER_ENGINES = ("docker", "ray:docker")  # the engines that take the Docker engine's `mode`
DOCKER_MODES = ("commit", "overlay")
LOCAL_ENGINES = ("local", "ray:local")  # the engines that take `trust_task_code` (Docker contains any task)
TRUST_ENV = "CRR_TRUST_TASK_CODE"  # =1: `crr --trust-task-code`, for every engine this process and its workers make

ENGINES: dict[str, Callable[..., ForkEngine]] = {"local": _local, "docker": _docker,
                                                 "ray:local": _on_ray("local"), "ray:docker": _on_ray("docker")}


def register_engine(name: str, factory: Callable[..., ForkEngine]) -> None:
    """Make `get_engine(name, **opts)` return `factory(**opts)`."""
    ENGINES[name] = factory


def get_engine(name: str, **opts) -> ForkEngine:
    """A fork engine by name; `opts` go to its factory (LocalEngine's, DockerEngine's constructor)."""
    if name not in ENGINES:
        raise CRRError(f"unknown fork engine {name!r}; choose one of {', '.join(ENGINES)}")
    return ENGINES[name](**opts)


def engine_options(engine: str, *, ray: str | None = None, mode: str | None = None,
                   trust_task_code: bool | None = None) -> dict:
    """get_engine's options for an engine's settings as commands and configs give them: `ray`, a Ray
    cluster's address as ray.init takes it, for a `ray:...` engine (None there: "auto", the cluster this
    machine belongs to); `mode` (commit or overlay) for docker and ray:docker; `trust_task_code` (None:
    $CRR_TRUST_TASK_CODE, which `crr --trust-task-code` sets) lets a local engine that cannot contain
    task code on its host run tasks that are not crr's own (crr.sandbox.local). A setting the engine does
    not take is a CRRError, which a command prints as one line (exit 2)."""
    opts: dict = {}
    if trust_task_code is None:
        trust_task_code = os.environ.get(TRUST_ENV) == "1"
    if trust_task_code and engine in LOCAL_ENGINES:
        opts["trust_task_code"] = True
    if engine.startswith(RAY_PREFIX):
        opts["address"] = "auto" if ray is None else ray
    elif ray is not None:
        raise CRRError(f"a Ray address (--ray {ray}) applies to --engine ray:local or ray:docker only, not to "
                       f"{engine!r}")
    if mode is not None:
        if engine not in DOCKER_ENGINES:
            raise CRRError(f"--mode applies to --engine docker or ray:docker only, not to {engine!r}")
        if mode not in DOCKER_MODES:
            raise CRRError(f"--mode is commit or overlay, got {mode!r}")
        opts["mode"] = mode
    return opts


def engine_workers(engine: ForkEngine, workers: int | None, default: int) -> int:
    """How many worker threads a driver (the rollout's pool, the filter, an evaluation) runs on `engine`:
    `workers` when the user set it; else the engine's `slots` where it has them (a Ray engine: the commands
    its cluster runs at once), else `default`."""
    if workers is not None:
        return workers
    slots = getattr(engine, "slots", None)
    if isinstance(slots, int) and slots > 0:
        log.info("%d workers: the sandbox slots of the %s engine", slots, getattr(engine, "name", "fork"))
        return slots
    return default


def reclaim_leftovers() -> list[str]:
    """Free what crr processes that no longer exist left behind on this host, on both engines: local
    sandbox mounts, directories and pids cgroups; Docker containers, snapshot images and overlay mounts
    (where a Docker daemon answers). Anything a live process owns is left. Returns what was removed."""
    from crr.sandbox import docker  # deferred with the engines above: the Docker SDK
    from crr.sandbox.local import gc_leftovers

    removed = gc_leftovers()
    try:
        removed += docker.gc()
    except SandboxError as e:  # no Docker daemon here: nothing of Docker's to reclaim
        log.debug("docker leftovers not reclaimed: %s", e)
    if removed:
        log.info("reclaimed %d leftovers of crr processes that no longer exist: %s", len(removed),
                    ", ".join(removed))
    return removed
