"""Sandboxes and fork engines, chosen by name: `get_engine("local")`, `get_engine("docker", mode=...)`."""

from __future__ import annotations

import logging

from crr.errors import CRRError, SandboxError
from crr.replay.base import ForkEngine

log = logging.getLogger(__name__)

ENGINES = ("local", "docker")


def get_engine(name: str, **opts) -> ForkEngine:
    """A fork engine by name; `opts` go to its constructor (LocalEngine, DockerEngine)."""
    if name == "local":
        from crr.replay.local import LocalEngine

        return LocalEngine(**opts)
    if name == "docker":
        from crr.replay.docker import DockerEngine  # imported lazily: it pulls in the Docker SDK

        return DockerEngine(**opts)
    raise CRRError(f"unknown fork engine {name!r}; choose one of {', '.join(ENGINES)}")


def reclaim_leftovers() -> list[str]:
    """Free what crr processes that no longer exist left behind on this host, on both engines: local
    sandbox mounts, directories and pids cgroups; Docker containers, snapshot images and overlay mounts
    (where a Docker daemon answers). Anything a live process owns is left. Returns what was removed."""
    from crr.replay import docker
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
