"""The `ray:local` and `ray:docker` fork engines: sandboxes on the nodes of a Ray cluster.

    engine = get_engine("ray:local", address="auto")        # or the address of a ray.cluster_utils.Cluster
    with engine.start(task) as sb:                           # on the least loaded sandbox node
        sb.exec("python -m pytest -q")                       # runs on that node
        snap = sb.snapshot()                                 # held by that node's sandbox host
        with engine.restore(snap) as fork: ...               # on the same node: the snapshot lives there
        engine.release(snap)

Callers see the ForkEngine / Sandbox protocol of crr.sandbox.base, as with the local and Docker engines,
so the episode loop, the verifier, the trainer and the filter run unchanged on a cluster.

Layout. Every alive node that offers the custom Ray resource `crr_sandbox` (started with e.g.
`ray start --address=HEAD --resources='{"crr_sandbox": 8}'`) gets one *sandbox host* per engine: a Ray
actor pinned to that node (NodeAffinitySchedulingStrategy, hard) that owns one inner engine there (the
`local` engine for `ray:local`, `docker` for `ray:docker`, built with the engine's remaining options:
`get_engine("ray:docker", mode="overlay")`), and holds that node's sandboxes and snapshots by id. The
RaySandbox a caller gets is a proxy: each call is one actor call to its host.

Placement. A node's capacity is its `crr_sandbox` count, capped at its CPUs / `cpus_per_sandbox`; at
most that many commands run at once on a node (more wait in the host). `start` spreads sandboxes over
the nodes: the host with the fewest live sandboxes per unit of capacity, ties taken round-robin.
A fork stays where its snapshot is: the snapshot's handle carries its host actor and node, and
`restore` runs there. The host actors claim no Ray CPU themselves (num_cpus=0): several engines (the
filter's recording and replaying ones) can then share a node, and the sandbox commands they run are
not Ray tasks, so Ray does not count them against the node's CPUs.

Faults. A host that dies (its node lost, its process killed) makes every later call on its sandboxes
and snapshots raise SandboxError, the infrastructure error of every engine: the episode is an infra
failure, never a reward of 0. No call waits forever: an exec waits for its command's timeout plus
`exec_margin_s`, anything else `call_timeout_s` (`start` gets `start_timeout_s`: it may clone a base
checkout or build an image). A dead host gets no new sandboxes.

Leftovers. A host's inner engine is the ordinary local or Docker engine of its node, with that
engine's directories, mounts, cgroups and container labels, owned by the host's worker process. When a
host dies without closing, what it left on its node is that engine's leftovers of a process that no
longer exists: `crr sandbox gc` (crr.sandbox.reclaim_leftovers) on that node finds and removes them,
as after any crashed crr process (with the same CRR_CACHE_DIR as the Ray node was started with).

Every node needs crr installed (the hosts import crr.sandbox there) and must be able to fetch each
task's repository: a task source that reads a path on the driver (`repo_src`) needs that path on the
node too (a shared file system); the bundled micro/nano sets ship inside the package.

This module imports ray at the top: crr.sandbox imports it only when an engine named `ray:...` is made.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import grpc
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from crr.errors import CRRError, SandboxError
from crr.sandbox.base import ClosingSandbox, ExecResult, ForkEngine, Sandbox, Snapshot, TaskSpec

log = logging.getLogger(__name__)

RESOURCE = "crr_sandbox"    # the custom Ray resource a node offers to host sandboxes; its count = slots
PREFIX = "ray:"             # engine names: ray:<inner engine>


class SandboxHost:
    """The Ray actor on one node: owns an inner fork engine there and its sandboxes and snapshots by id.

    Threaded (max_concurrency): commands of different sandboxes overlap, as the rollout's thread pool
    expects; at most `slots` commands run at once.
    """

    def __init__(self, factory: Callable[..., ForkEngine], inner_opts: dict, slots: int):
        self.engine = factory(**inner_opts)
        self._sandboxes: dict[int, Sandbox] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self._slots = threading.BoundedSemaphore(max(1, slots))
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def info(self) -> dict:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "engine_dir": str(getattr(self.engine, "dir", None) or getattr(self.engine, "root", None) or "")}

    def start(self, task: TaskSpec) -> tuple[int, str]:
        return self._add(self.engine.start(task))

    def restore(self, snapshot_id: str) -> tuple[int, str]:
        with self._lock:
            snap = self._snapshots.get(snapshot_id)
        if snap is None:
            raise CRRError(f"snapshot {snapshot_id} is not held by this sandbox host (released, or the "
                           "engine was closed)")
        return self._add(self.engine.restore(snap))

    def exec(self, sid: int, command: str, timeout: float, env: dict[str, str] | None) -> ExecResult:
        sb = self._get(sid)
        with self._slots:
            if env is None:
                return sb.exec(command, timeout=timeout)
            return sb.exec(command, timeout=timeout, env=env)

    def read_file(self, sid: int, path: str) -> bytes:
        return self._get(sid).read_file(path)

    def write_file(self, sid: int, path: str, data: bytes) -> None:
        self._get(sid).write_file(path, data)

    def snapshot(self, sid: int) -> tuple[str, dict]:
        snap = self._get(sid).snapshot()
        with self._lock:
            self._snapshots[snap.id] = snap
        return snap.id, snap.handle

    def close_sandbox(self, sid: int) -> None:
        with self._lock:
            sb = self._sandboxes.pop(sid, None)
        if sb is not None:
            sb.close()

    def release(self, snapshot_id: str) -> None:
        with self._lock:
            snap = self._snapshots.pop(snapshot_id, None)
        if snap is not None:
            self.engine.release(snap)

    def close(self) -> None:
        with self._lock:
            self._sandboxes.clear()
            self._snapshots.clear()
        self.engine.close()  # closes its sandboxes and snapshots

    def _add(self, sb: Sandbox) -> tuple[int, str]:
        with self._lock:
            sid = next(self._ids)
            self._sandboxes[sid] = sb
        return sid, sb.repo_dir

    def _get(self, sid: int) -> Sandbox:
        with self._lock:
            sb = self._sandboxes.get(sid)
        if sb is None:
            raise CRRError(f"sandbox {sid} is closed")
        return sb


@dataclass
class _Host:
    actor: Any            # the SandboxHost actor handle
    node: str             # Ray node id (hex)
    capacity: int
    info: dict
    live: int = 0         # sandboxes of this engine open there
    dead: str | None = None  # why the host is gone, once it is


class RayEngine:
    """Fork engine whose sandboxes live on the sandbox nodes of a Ray cluster (module doc).

    inner: the engine each node runs (`local`, `docker`, or any registered name whose factory the
    nodes can import); inner_opts: its options. address: as ray.init takes it ("auto": the cluster
    this machine belongs to; "local": a one-node Ray started here, every CPU a sandbox slot); used only
    when this process has not connected to Ray yet.
    """

    def __init__(self, inner: str = "local", *, factory: Callable[..., ForkEngine], address: str | None = "auto",
                 resource: str = RESOURCE, cpus_per_sandbox: float = 1.0, call_timeout_s: float = 300.0,
                 start_timeout_s: float = 1800.0, exec_margin_s: float = 30.0, rescan_s: float = 30.0,
                 **inner_opts):
        if cpus_per_sandbox <= 0:
            raise CRRError(f"cpus_per_sandbox must be positive, got {cpus_per_sandbox}")
        self.name = f"{PREFIX}{inner}"
        self.inner = inner
        self.resource, self.cpus_per_sandbox = resource, cpus_per_sandbox
        self.call_timeout_s, self.start_timeout_s, self.exec_margin_s = call_timeout_s, start_timeout_s, exec_margin_s
        self._factory, self._inner_opts = factory, inner_opts
        self.rescan_s, self._scanned = rescan_s, 0.0
        self._scan_lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._sandboxes: set[RaySandbox] = set()
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        _connect(address)
        self._failed: dict[str, str] = {}  # node -> why no host could start there
        self._add_hosts()
        if not self._hosts and self._failed:
            self.close()
            raise SandboxError(f"no sandbox host of {self.name} could start: "
                               + "; ".join(f"node {n[:8]}: {why}" for n, why in self._failed.items()))
        if not self._hosts:
            raise CRRError(f"no alive node of the Ray cluster offers the {resource!r} resource, so {self.name} "
                           f"has nowhere to put sandboxes: start sandbox nodes with "
                           f"`ray start --address=HEAD --resources='{{\"{resource}\": 8}}'` (8 slots)")

    # --- the ForkEngine protocol ------------------------------------------------------------------
    def start(self, task: TaskSpec) -> RaySandbox:
        if time.monotonic() - self._scanned > self.rescan_s:
            self._add_hosts()  # nodes that joined since get hosts too
        host = self._pick()
        return self._open(host, "start", task, timeout=self.start_timeout_s, task=task,
                          what=f"starting a sandbox of {task.instance_id}")

    def restore(self, snapshot: Snapshot) -> RaySandbox:
        host = self._holder(snapshot)
        with self._lock:
            self._check_open()
            host.live += 1
        return self._open(host, "restore", snapshot.id, timeout=self.call_timeout_s, task=snapshot.handle["task"],
                          what=f"restoring a snapshot of {snapshot.task_id}")

    def release(self, snapshot: Snapshot) -> None:
        try:
            host = self._holder(snapshot)
        except CRRError:
            return  # not this engine's: nothing of it to free (as the local engine does)
        if host.dead:
            return  # what it held went with it (crr sandbox gc on its node reclaims the rest)
        try:
            self._call(host, "release", snapshot.id, timeout=self.call_timeout_s,
                       what=f"releasing a snapshot of {snapshot.task_id}")
        except SandboxError as e:
            log.warning("snapshot %s not released: %s", snapshot.id, e)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sandboxes, self._sandboxes = list(self._sandboxes), set()
        for sb in sandboxes:
            sb._closed = True  # their host closes them with its engine, below
        hosts = [h for h in self._hosts.values() if not h.dead]
        refs = [h.actor.close.remote() for h in hosts]  # all at once, then wait for each
        for host, ref in zip(hosts, refs):
            try:
                self._wait(host, ref, timeout=self.call_timeout_s, what="closing the sandbox host")
            except CRRError as e:
                log.warning("sandbox host on node %s did not close cleanly: %s", host.node, e)
        for host in self._hosts.values():
            _kill(host.actor)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- placement --------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Commands that can run at once over the live hosts: a fitting number of rollout/filter workers."""
        with self._lock:
            return sum(h.capacity for h in self._hosts.values() if not h.dead)

    def hosts(self) -> list[dict]:
        """One row per sandbox host: node, pid, hostname, capacity, live sandboxes, and why it died."""
        with self._lock:
            return [{**h.info, "capacity": h.capacity, "live": h.live, "dead": h.dead}
                    for h in self._hosts.values()]

    def _add_hosts(self) -> None:
        """A sandbox host on every alive node with the resource that has none yet (nodes that joined)."""
        if not self._scan_lock.acquire(blocking=False):
            return  # another thread is scanning
        try:
            self._scanned = time.monotonic()
            self._scan()
        finally:
            self._scan_lock.release()

    def _scan(self) -> None:
        new: list[_Host] = []
        for node in ray.nodes():
            res, node_id = node.get("Resources", {}), node["NodeID"]
            if (not node.get("Alive") or res.get(self.resource, 0) <= 0 or node_id in self._hosts
                    or node_id in self._failed):
                continue
            cpus = res.get("CPU", 0.0)
            capacity = max(1, int(min(res[self.resource], cpus / self.cpus_per_sandbox if cpus else 1)))
            actor = ray.remote(SandboxHost).options(
                num_cpus=0, max_concurrency=capacity + 32, max_restarts=0, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self._factory, self._inner_opts, capacity)
            new.append(_Host(actor=actor, node=node_id, capacity=capacity, info={}))
        refs = [h.actor.info.remote() for h in new]
        for host, ref in zip(new, refs):
            try:
                host.info = self._wait(host, ref, timeout=self.start_timeout_s, what="starting the sandbox host")
            except CRRError as e:  # its engine could not start there (no Docker daemon, ...)
                log.warning("no sandbox host on node %s: %s", host.node, e)
                self._failed[host.node] = str(e)
                _kill(host.actor)
                continue
            with self._lock:
                if not self._closed:
                    self._hosts[host.node] = host
                    continue
            _kill(host.actor)  # the engine closed while this host started
        if new:
            log.info("%s: sandbox hosts on %d nodes (%s)", self.name, len(self._hosts),
                     ", ".join(f"{h.node[:8]}x{h.capacity}" for h in self._hosts.values()))

    def _pick(self) -> _Host:
        """The live host with the fewest sandboxes per slot; ties go round-robin."""
        with self._lock:
            self._check_open()
            alive = [h for h in self._hosts.values() if not h.dead]
            if not alive:
                raise SandboxError(f"every sandbox host of this {self.name} engine is gone: "
                                   + "; ".join(f"{h.node[:8]}: {h.dead}" for h in self._hosts.values()))
            turn = next(self._turn)
            order = alive[turn % len(alive):] + alive[:turn % len(alive)]
            host = min(order, key=lambda h: h.live / h.capacity)
            host.live += 1  # claimed now, so concurrent starts spread too
            return host

    def _check_open(self) -> None:
        if self._closed:
            raise CRRError(f"this {self.name} engine is closed; make a new one")

    def _holder(self, snapshot: Snapshot) -> _Host:
        if snapshot.engine != self.name:
            raise CRRError(f"snapshot {snapshot.id} is from the {snapshot.engine} engine, not {self.name}")
        host = self._hosts.get(snapshot.handle.get("node", ""))
        if host is None or host.actor != snapshot.handle.get("host"):
            raise CRRError(f"snapshot {snapshot.id} is not held by this {self.name} engine")
        return host

    def _open(self, host: _Host, method: str, *args, timeout: float, task: TaskSpec, what: str) -> RaySandbox:
        """A sandbox made by `method` on `host` (whose `live` count already holds it)."""
        try:
            sid, repo_dir = self._call(host, method, *args, timeout=timeout, what=what)
        except BaseException:
            with self._lock:
                host.live = max(0, host.live - 1)
            raise
        sb = RaySandbox(self, host, sid, task, repo_dir)
        with self._lock:
            self._sandboxes.add(sb)
        return sb

    def _forget(self, sb: RaySandbox) -> None:
        with self._lock:
            self._sandboxes.discard(sb)
            sb.host.live = max(0, sb.host.live - 1)

    def _call(self, host: _Host, method: str, *args, timeout: float, what: str):
        """Call `method` of the host actor and wait for its answer (see `_wait`)."""
        if host.dead:
            raise SandboxError(f"{what}: the sandbox host on node {host.node} is gone ({host.dead})")
        return self._wait(host, getattr(host.actor, method).remote(*args), timeout=timeout, what=what)

    def _wait(self, host: _Host, ref, *, timeout: float, what: str):
        """ray.get with a timeout; a dead or silent host is a SandboxError, the host's own errors
        (CRRError for a bad path or a closed sandbox, SandboxError from its engine) come back as they
        were raised there."""
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, Exception) and not isinstance(cause, RayError):
                raise cause from None
            raise SandboxError(f"{what} on node {host.node} failed: {e}") from None
        except GetTimeoutError:
            raise SandboxError(f"{what}: the sandbox host on node {host.node} did not answer within "
                               f"{timeout:.0f} s") from None
        except RayError as e:  # the actor or its node died
            host.dead = _why(e)
            raise SandboxError(f"{what}: the sandbox host on node {host.node} died ({host.dead})") from None


class RaySandbox(ClosingSandbox):
    """A sandbox held by a sandbox host on some node; each call is one actor call there."""

    def __init__(self, engine: RayEngine, host: _Host, sid: int, task: TaskSpec, repo_dir: str):
        self.task, self.repo_dir = task, repo_dir
        self.host, self.node = host, host.node
        self._engine, self._sid = engine, sid
        self._closed = False

    def exec(self, command: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> ExecResult:
        self._check_open()
        return self._engine._call(self.host, "exec", self._sid, command, timeout, env,
                                  timeout=timeout + self._engine.exec_margin_s,
                                  what=f"a command in {self.task.instance_id}")

    def read_file(self, path: str) -> bytes:
        self._check_open()
        return self._engine._call(self.host, "read_file", self._sid, path, timeout=self._engine.call_timeout_s,
                                  what=f"reading {path} in {self.task.instance_id}")

    def write_file(self, path: str, data: bytes) -> None:
        self._check_open()
        self._engine._call(self.host, "write_file", self._sid, path, data, timeout=self._engine.call_timeout_s,
                           what=f"writing {path} in {self.task.instance_id}")

    def snapshot(self) -> Snapshot:
        self._check_open()
        snap_id, inner = self._engine._call(self.host, "snapshot", self._sid, timeout=self._engine.call_timeout_s,
                                            what=f"a snapshot of {self.task.instance_id}")
        return Snapshot(id=snap_id, engine=self._engine.name, task_id=self.task.instance_id,
                        handle={"host": self.host.actor, "node": self.node, "task": self.task, "inner": inner})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._forget(self)
        if self.host.dead:
            return
        try:
            self._engine._call(self.host, "close_sandbox", self._sid, timeout=self._engine.call_timeout_s,
                               what=f"closing the sandbox of {self.task.instance_id}")
        except SandboxError as e:  # its host is gone, and the sandbox with it
            log.debug("sandbox of %s not closed: %s", self.task.instance_id, e)



def _why(e: RayError) -> str:
    """One line on why a host died: the exception its engine raised at start-up, or Ray's reason."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if isinstance(e, RayActorError) and e.actor_init_failed:
        return f"its engine failed to start: {lines[-1]}"
    return f"{type(e).__name__}: {lines[0]}" + (f" {lines[-1]}" if len(lines) > 1 else "")


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except (RayError, ValueError) as e:  # gone already
        log.debug("ray.kill: %s", e)


def _connect(address: str | None) -> None:
    """Join the Ray cluster at `address` unless this process already has; "local" starts a one-node Ray on
    this machine whose every CPU is a sandbox slot (ended with this process)."""
    if ray.is_initialized():
        return
    opts = {"resources": {RESOURCE: os.cpu_count() or 1}, "include_dashboard": False} if address == "local" else {}
    try:
        _check_answers(address)
        ray.init(address=address, configure_logging=False, **opts)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CRRError(f"cannot connect to a Ray cluster at {address!r}: {str(e).rstrip('.')}. Start one "
                       f"(`ray start --head --resources='{{\"{RESOURCE}\": 8}}'`), pass its address, or pass "
                       "address='local' for a one-node Ray on this machine") from None


def _check_answers(address: str | None) -> None:
    """A ConnectionError unless a Ray cluster answers at the address ray.init would dial (none for "local" or a
    ray:// client): where nothing or something else listens, Ray's C++ client retries for up to minutes,
    printing a warning every few seconds."""
    try:   # Ray's own helpers, private (requirements.lock pins the Ray they are read from): where a later Ray
        # moved them, ray.init is left to find out, as it did before this check
        from ray._private.gcs_utils import create_gcs_channel
        from ray._private.services import canonicalize_bootstrap_address
        from ray.core.generated.gcs_service_pb2 import GetClusterIdRequest
        from ray.core.generated.gcs_service_pb2_grpc import NodeInfoGcsServiceStub
    except ImportError:
        return
    gcs = None if "://" in (address or "") else canonicalize_bootstrap_address(address)  # as ray.init does it
    if gcs is None:
        return
    with create_gcs_channel(gcs) as channel:
        try:
            NodeInfoGcsServiceStub(channel).GetClusterId(GetClusterIdRequest(), timeout=10)
        except grpc.RpcError as e:  # another answer (unauthenticated, ...) is a cluster's: ray.init says more
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.UNIMPLEMENTED):
                raise ConnectionError(f"no Ray cluster answers at {gcs} ({e.details()})") from None
