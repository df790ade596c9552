"""Sandboxes and fork engines, chosen by name: `get_engine("local")`, `get_engine("docker", mode=...)`."""

from __future__ import annotations

from crr.errors import CRRError
from crr.replay.base import ForkEngine

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
