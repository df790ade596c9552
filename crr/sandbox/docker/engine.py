"""DockerEngine: the ForkEngine protocol over Docker containers (package doc), and the containers it runs;
images, snapshots, the warm pool and the disk watch are its parts in the modules beside this one."""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Literal, Self

import docker.errors
import requests
from docker.types import Mount, Ulimit

from crr.errors import CRRError, SandboxError
from crr.sandbox import http
from crr.sandbox.base import Snapshot, TaskSpec
from crr.sandbox.checkout import base_checkout, cache_root
from crr.sandbox.docker.common import (_LOG, _MS_BIND, _MS_SHARED, _PID1, CTL_DIR, CTL_TMPFS_MB,
                                       DEFAULT_BASE_IMAGE, ENGINE, REPO_DIR, ROLE, _Container, _docker_errors,
                                       _dispose_root, _mount_call, _owner_labels, docker_client)
from crr.sandbox.docker.disk import LayerCap
from crr.sandbox.docker.images import Images
from crr.sandbox.docker.pool import WarmPool, _fresh_state, _scratch_dirs
from crr.sandbox.docker.reclaim import _remove_images
from crr.sandbox.docker.sandbox import DockerSandbox
from crr.sandbox.docker.snapshots import Snapshots, _Held
from crr.sandbox.engines import Option, check_values
from crr.sandbox.overlay import OverlayWorkspace, mount_tmpfs, unmount

log = logging.getLogger(__name__)


class DockerEngine(Images, Snapshots, WarmPool, LayerCap):
    """Fork engine over Docker containers; `mode` picks commit or overlay snapshots (package doc).

    image: the base image for tasks without their own (default $CRR_BASE_IMAGE or crr-base:bookworm).
    pool_size: overlay mode, warm containers kept ready per image.
    fsize_limit_mb: any one file; disk_limit_mb: /tmp, the overlay workspace and, where the storage
    driver takes a quota, the writable layer (package doc).
    record_http: containers get the host's network and record HTTP (package doc).
    """

    name = "docker"
    # What each option takes (crr.sandbox.engines checks them before any container starts); mem_limit is
    # the Docker SDK's (bytes, or a size such as 4g).
    OPTIONS: ClassVar[dict[str, Option]] = {
        "mode": Option(str, choices=("commit", "overlay")), "image": Option(str, none=True),
        "mem_limit": Option(str, pattern=r"[1-9]\d*[bkmgBKMG]?", note="a number of bytes or a size such as 4g"),
        "cpus": Option(float, above=0), "pids_limit": Option(int, least=1),
        "fsize_limit_mb": Option(int, least=1, note="MB"), "disk_limit_mb": Option(int, least=1, note="MB"),
        "flatten_depth": Option(int, least=2, most=120, note="overlay2 fails near 125 layers"),
        "pool_size": Option(int, least=0), "record_http": Option(bool)}

    def __init__(self, mode: Literal["commit", "overlay"] = "commit", image: str | None = None,
                 mem_limit: str = "2g", cpus: float = 1.0, pids_limit: int = 512,
                 fsize_limit_mb: int = 1024, disk_limit_mb: int = 1024,
                 flatten_depth: int = 100, pool_size: int = 2, record_http: bool = False):
        check_values(self.name, {"mode": mode, "flatten_depth": flatten_depth}, self.OPTIONS)
        self.mode, self.mem_limit, self.cpus, self.pids_limit = mode, mem_limit, cpus, pids_limit
        self.flatten_depth, self.pool_size = flatten_depth, max(0, pool_size)
        self.fsize_limit_mb, self.disk_limit_mb = fsize_limit_mb, disk_limit_mb
        self._layer_quota: bool | None = None  # does the storage driver take --storage-opt size=? (first start)
        self._warned_unwatched = False  # commit mode, no quota, not root: said once
        self._docker_root: str | None = None  # the daemon's directory (commit mode's disk watch)
        self.record_http = record_http
        self.base_image = image or os.environ.get("CRR_BASE_IMAGE", DEFAULT_BASE_IMAGE)
        self.client = docker_client()
        self.api = self.client.api
        self.id = uuid.uuid4().hex[:10]
        self.labels = _owner_labels(self.id)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._sandboxes: dict[str, DockerSandbox] = {}
        self._held: dict[str, _Held] = {}
        self._warm: dict[str, deque[Future]] = {}  # overlay mode: image -> ready (or starting) containers
        self._background = ThreadPoolExecutor(1, thread_name_prefix=f"crr-{self.id}")
        self._closed = False
        self.root = self._make_root()
        atexit.register(self.close)  # an interrupted run still removes what it made

    # -- the ForkEngine protocol -----------------------------------------------------------------

    def start(self, task: TaskSpec) -> DockerSandbox:
        """A fresh sandbox with the task's repository at base_commit in /testbed."""
        self._check_open()
        if self.mode == "commit":
            image = self._task_image(task)
            sb = self._commit_sandbox(task, image, depth=self._layers(image))
        else:
            image = task.image or self._env_image(task)
            self._require_image(image, task)
            lower = self._image_testbed(image) if task.image else base_checkout(task)
            sb = self._overlay_sandbox(task, image, lambda root: OverlayWorkspace(root, lower))
        return http.install_cassette(sb, self.record_http)

    def restore(self, snapshot: Snapshot) -> DockerSandbox:
        """An independent sandbox in exactly the state `snapshot` was taken in."""
        self._check_open()
        with self._lock:
            held = self._held.get(snapshot.id)
            if held is None or held.released:
                raise CRRError(f"snapshot {snapshot.id} is not held by this docker engine "
                               "(released, or taken by another engine)")
            held.users += 1
        try:
            if self.mode == "commit":
                return self._commit_sandbox(held.task, held.image, held.depth, snapshot.id)
            return self._overlay_sandbox(held.task, held.image,
                                         lambda root: OverlayWorkspace.restore(held.layer, root), snapshot.id)
        except BaseException:
            self._unuse(snapshot.id)
            raise

    def release(self, snapshot: Snapshot) -> None:
        """Drop a snapshot; its image or layer goes once the last sandbox restored from it closes."""
        with self._lock:
            held = self._held.get(snapshot.id)
            if held is None or held.released:
                return
            held.released = True
        self._unuse(snapshot.id, drop=0)

    def close(self) -> None:
        """Remove every container, snapshot image, mount and temp dir this engine made; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            for sb in list(self._sandboxes.values()):
                try:
                    sb.close()
                except Exception as e:  # noqa: BLE001 - keep removing the rest
                    log.warning("closing %s: %s", sb.name, e)
            for sid in list(self._held):
                self.release(Snapshot(sid, self.name, ""))
        finally:
            self._background.shutdown(wait=True)  # pending starts, recycles and removals finish first
            for queue in self._warm.values():
                for fut in queue:
                    if fut.exception() is None:
                        self._discard(fut.result())
            self._sweep()
            _dispose_root(self.root)

    def _sweep(self) -> None:
        """Remove whatever still carries this engine's label (a start or commit cut short by an
        interrupt, say): nothing outlives its owner."""
        label = f"{ENGINE}={self.id}"
        try:
            for c in self.api.containers(all=True, filters={"label": label}):
                self.api.remove_container(c["Id"], force=True)
            _remove_images(self.api, self.api.images(all=True, filters={"label": [label, f"{ROLE}=snapshot"]}))
        except (docker.errors.DockerException, requests.RequestException) as e:
            log.warning("engine %s: could not remove all its leftovers (%s); crr sandbox gc will", self.id, e)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- containers -------------------------------------------------------------------------------

    def _make_root(self) -> Path:
        """This engine's host directory (command channels; overlay: slots, workspaces, layers, scratch tmpfs).

        In overlay mode it is bind-mounted on itself and made a shared mount: Docker's `rslave`
        propagation needs its source on a shared (or slave) mount, the host's / is private here,
        and a crr-owned bind leaves everyone else's propagation as it was.
        """
        root = cache_root() / "docker" / f"crr-docker-{os.getpid()}-{self.id}"
        root.mkdir(parents=True)
        try:
            (root / "owner.json").write_text(json.dumps(self.labels))
            (root / "ctl").mkdir()
            if self.mode == "overlay":
                _mount_call(str(root), str(root), _MS_BIND)
                _mount_call(None, str(root), _MS_SHARED)
                for sub in ("slots", "ws", "layers", "scratch"):
                    (root / sub).mkdir()
        except BaseException:
            _dispose_root(root)
            raise
        return root

    def _run(self, image: str, labels: dict[str, str], slot: Path | None = None) -> _Container:
        """Create and start a locked-down container from a local image (create never pulls). With a
        `slot` (overlay mode) its root is read-only and what stays writable is a capped tmpfs (package doc)."""
        name = f"crr-{self.id}-{next(self._seq)}"
        box = _Container("", name, self.root / "ctl" / name, slot)
        fsize = self.fsize_limit_mb << 20
        try:
            box.ctl.mkdir()
            mounts = [Mount(CTL_DIR, str(box.ctl), type="bind")]
            tmpfs = {"/tmp": f"size={self.disk_limit_mb}m,mode=1777,exec"}  # commit mode: never committed
            if os.geteuid() == 0:  # not in commit mode run by a user: the disk watch needs root too
                mount_tmpfs(box.ctl, CTL_TMPFS_MB)
            if slot is not None:
                box.scratch = self.root / "scratch" / name
                box.scratch.mkdir()
                mount_tmpfs(box.scratch, self.disk_limit_mb)
                for path, host in _scratch_dirs(box):
                    host.mkdir()
                    host.chmod(0o700 if path == "/root" else 0o1777)
                    mounts.append(Mount(path, str(host), type="bind"))
                mounts.append(Mount(REPO_DIR, str(slot), type="bind", propagation="rslave"))
                tmpfs = {}
            os.mkfifo(box.ctl / "req")
            settings = dict(entrypoint=_PID1, command=[], name=name, labels={**self.labels, **labels},
                            working_dir=REPO_DIR, network_mode="host" if self.record_http else "none",
                            mem_limit=self.mem_limit, nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids_limit,
                            mounts=mounts, ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize)],
                            tmpfs=tmpfs, read_only=slot is not None, log_config=_LOG)
            with _docker_errors(f"start a container from {image}"):
                container = self._create(image, settings)
                box.id = container.id
                if slot is None:
                    box.watch = self._watched(container)
                container.start()
                self._wait_for_pid1(box)
                if slot is not None:
                    attrs = self.api.inspect_container(container.id)
                    box.pid, box.upper = attrs["State"]["Pid"], attrs["GraphDriver"]["Data"].get("UpperDir", "")
                    box.fresh = _fresh_state(box)
        except BaseException:
            self._discard(box)
            raise
        return box

    def _wait_for_pid1(self, box: _Container, limit_s: float = 30.0) -> None:
        """Return once PID 1 holds the request FIFO (open() fails with ENXIO until it does)."""
        deadline, next_check = time.monotonic() + limit_s, time.monotonic() + 1.0
        while True:
            try:
                os.close(os.open(box.ctl / "req", os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
                return
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
            if time.monotonic() > next_check:  # a PID 1 that died (no sh in the image?) won't come
                state = self.api.inspect_container(box.id)["State"]
                if not state["Running"] or time.monotonic() > deadline:
                    logs = self.api.logs(box.id, tail=5).decode(errors="replace").strip()
                    raise SandboxError(f"container {box.name} did not come up ({state['Status']}); "
                                       f"its image needs /bin/sh; log: {logs or '(empty)'}")
                next_check = time.monotonic() + 1.0
            time.sleep(0.002)

    def _discard(self, box: _Container) -> None:
        if box.id:
            try:
                self.api.remove_container(box.id, force=True)
            except docker.errors.NotFound:
                pass
            except (docker.errors.DockerException, requests.RequestException) as e:
                log.warning("could not remove container %s: %s (crr sandbox gc will)", box.name, e)
        for tmpfs in (box.ctl, box.scratch):  # tmpfs mounts where crr runs as root
            if tmpfs is not None:
                if os.path.ismount(tmpfs):
                    unmount(str(tmpfs))
                shutil.rmtree(tmpfs, ignore_errors=True)
        if box.slot is not None:
            with contextlib.suppress(OSError):
                box.slot.rmdir()

    def _register(self, sb: DockerSandbox) -> DockerSandbox:
        with self._lock:
            self._sandboxes[sb.name] = sb
        return sb

    def _close_sandbox(self, sb: DockerSandbox) -> None:
        with self._lock:
            self._sandboxes.pop(sb.name, None)
        try:
            if sb.workspace is None:
                self._discard(sb.box)
            else:
                # The slot first: it is all the container sees of the workspace, and no process holds
                # it (actions leave none behind; PID 1 sits in /).
                unmount(str(sb.box.slot))
                sb.workspace.close()
                _dispose_root(sb.workspace.root.parent)  # its tmpfs
                self._background.submit(self._recycle, sb.image, sb.box)
        finally:
            if sb.snapshot_id is not None:
                self._unuse(sb.snapshot_id)
    def _check_open(self) -> None:
        if self._closed:
            raise CRRError("this docker engine is closed")
