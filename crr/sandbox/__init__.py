"""The sandbox layer: sandboxes, fork engines and the snapshot/fork protocol (crr.sandbox.base), their gc,
base checkouts, package mirrors and HTTP record/replay.

HTTP record/replay (http.py, and http_plugin.py that runs inside a sandbox) lives here too, not in a
`replay/` of its own: it is a door of the sandbox (a cassette installed into a sandbox, read by a plugin
inside it, set up by mirror.py), and "replay" in crr's other names (`replay_at`, `crr replay verify`,
train/replay_noise.py) means re-running an episode's actions, which belongs to the agent and train layers.

    local/, overlay.py     the local engine (namespaces, overlayfs or copies, cgroups), split by concern, and
                           its workspaces
    docker/                the Docker engine (commit and overlay snapshots), split by concern
    ray_engine.py          ray:<engine>: any engine on the nodes of a Ray cluster
    engines.py             the engine spec: a name or dotted path plus options, checked by the engine
    checkout.py, mirror.py base checkouts of a task's repository; its hash-pinned environment
    http.py                HTTP record/replay

Engines are chosen by an engine spec (crr.sandbox.engines): `get_engine("local")`,
`get_engine("docker", mode="overlay")`, `get_engine("ray:local", address="auto")`, or
`engine_spec(name, options, ray=..., mode=...).make()`. A new engine is a class with the ForkEngine
protocol, named by its dotted path (`--engine mypkg.engines:Firecracker`) or registered:

    register_engine("firecracker", FirecrackerEngine)  # get_engine("firecracker", **opts) -> FirecrackerEngine(**opts)

tests/test_engine_contract.py runs the same contract against every engine; a new one adds one line there.
"""

from __future__ import annotations

import logging

from crr.errors import SandboxError
from crr.sandbox.engines import (ENGINES, RAY_OPTIONS, RAY_PREFIX, TRUST_ENV, EngineSpec, engine_class,
                                 engine_spec, engine_spec_of, engine_workers,
                                 get_engine, parse_options, register_engine)

__all__ = ["ENGINES", "RAY_OPTIONS", "RAY_PREFIX", "TRUST_ENV", "EngineSpec", "engine_class", "engine_spec",
           "engine_spec_of", "engine_workers", "get_engine", "parse_options", "reclaim_leftovers", "register_engine"]

log = logging.getLogger(__name__)


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
