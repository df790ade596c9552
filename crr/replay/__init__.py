"""Sandboxes and fork engines, chosen by name: `get_engine("local")`, `get_engine("docker", mode=...)`,
`get_engine("ray:local", address="auto")` (sandboxes on a Ray cluster's nodes, crr.replay.ray_engine).

A fork engine (the ForkEngine protocol of crr.replay.base) is registered under a name with a factory that
takes the engine's options; a new one is

    register_engine("firecracker", FirecrackerEngine)      # get_engine("firecracker", **opts) -> FirecrackerEngine(**opts)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from crr.errors import CRRError, SandboxError
from crr.replay.base import ForkEngine

log = logging.getLogger(__name__)


def _local(**opts) -> ForkEngine:
    from crr.replay.local import LocalEngine  # deferred: ~50 ms of imports that naming an engine need not pay

    return LocalEngine(**opts)


def _docker(**opts) -> ForkEngine:
    from crr.replay.docker import DockerEngine  # deferred: it pulls in the Docker SDK

    return DockerEngine(**opts)


def _on_ray(inner: str) -> Callable[..., ForkEngine]:
    """The factory of `ray:<inner>`: sandboxes on a Ray cluster's nodes, each node running `inner`
    (crr.replay.ray_engine). Options: address ("auto", as ray.init takes it; "local": a one-node Ray on
    this machine), cpus_per_sandbox, resource, timeouts; the rest go to the inner engine on every node."""

    def make(**opts) -> ForkEngine:
        # deferred: importing ray costs ~0.3 s (more on a busy machine) that `crr --help` and the light
        # commands need not pay; only an engine named ray:... does (ray is the optional `ray` extra).
        try:
            from crr.replay.ray_engine import RayEngine
        except ImportError as e:
            raise CRRError(f"engine ray:{inner} needs Ray: pip install -e '.[ray]' ({e})") from None
        return RayEngine(inner, factory=ENGINES[inner], **opts)

    return make


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


def reclaim_leftovers() -> list[str]:
    """Free what crr processes that no longer exist left behind on this host, on both engines: local
    sandbox mounts, directories and pids cgroups; Docker containers, snapshot images and overlay mounts
    (where a Docker daemon answers). Anything a live process owns is left. Returns what was removed."""
    from crr.replay import docker  # deferred with the engines above: the Docker SDK
    from crr.replay.local import gc_leftovers

    removed = gc_leftovers()
    try:
        removed += docker.gc()
    except SandboxError as e:  # no Docker daemon here: nothing of Docker's to reclaim
        log.debug("docker leftovers not reclaimed: %s", e)
    if removed:
        log.info("reclaimed %d leftovers of crr processes that no longer exist: %s", len(removed),
                    ", ".join(removed))
    return removed
