"""Overlay mode's warm pool: running containers with an empty /testbed slot, topped up in the background so
that a fork waits for no container start, and taken back only when exactly as fresh as they started."""

from __future__ import annotations

import logging
import os
import uuid
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import docker.errors
import requests

from crr.sandbox.docker.common import ROLE, SCRATCH_DIRS, _Container

log = logging.getLogger(__name__)


class WarmPool:
    """Methods of DockerEngine (its _warm, pool_size, _background, _run, _discard)."""

    def _take_warm(self, image: str) -> _Container:
        """A running container of `image` with an empty /testbed slot. The pool is topped up in the
        background, so that a fork waits for no container start."""
        with self._lock:
            queue = self._warm.setdefault(image, deque())
            fut = queue.popleft() if queue else self._background.submit(self._start_warm, image)
            if len(queue) < self.pool_size:
                self._background.submit(self._refill, image)
        try:
            return fut.result()
        except BaseException:  # interrupted while waiting: the container must not go astray
            fut.add_done_callback(lambda f: f.exception() or self._discard(f.result()))
            raise

    def _start_warm(self, image: str) -> _Container:
        slot = self.root / "slots" / uuid.uuid4().hex[:12]
        slot.mkdir()
        return self._run(image, {ROLE: "sandbox"}, slot=slot)

    def _refill(self, image: str) -> None:
        while not self._closed:
            with self._lock:
                if len(self._warm[image]) >= self.pool_size:
                    return
            box = self._start_warm(image)
            with self._lock:
                self._warm[image].append(_done(box))

    def _recycle(self, image: str, box: _Container) -> None:
        """Back into the pool if the container is still exactly fresh outside /testbed, else removed."""
        with self._lock:
            room = not self._closed and len(self._warm[image]) < 2 * self.pool_size
        try:
            clean = (room and self.api.inspect_container(box.id)["State"]["Pid"] == box.pid
                     and _fresh_state(box) == box.fresh)
        except (OSError, docker.errors.DockerException, requests.RequestException):  # it is gone
            clean = False
        if not clean:
            self._discard(box)
            return
        with self._lock:
            self._warm[image].append(_done(box))


def _done(box: _Container) -> Future:
    fut: Future = Future()
    fut.set_result(box)
    return fut


def _scratch_dirs(box: _Container) -> list[tuple[str, Path]]:
    """(path in the container, host dir) of each writable dir of an overlay-mode container's read-only root."""
    return [(path, box.scratch / path.strip("/").replace("/", "-")) for path in SCRATCH_DIRS]


def _fresh_state(box: _Container) -> tuple:
    """What must be as it started for an overlay-mode container to go back to the pool: its writable
    layer entry by entry (the root is read-only: checked all the same), each scratch dir, /dev,
    /dev/shm and /dev/mqueue (Docker's own tmpfs and mqueue mounts), and its command channel. A
    directory's ctime moves with every entry made, removed or renamed in it and every chmod or
    chown of it, and these start empty (/dev: only device nodes and links), so its stat is its state."""
    root = f"/proc/{box.pid}/root"
    dirs = [*(host for _, host in _scratch_dirs(box)), f"{root}/dev", f"{root}/dev/shm", f"{root}/dev/mqueue"]
    stats = [(st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_ctime_ns) for st in map(os.lstat, dirs)]
    with os.scandir(box.ctl) as entries:  # the host makes and removes action dirs here: only "req" stays
        channel = sorted((e.name, e.inode()) for e in entries)
    return _layer_state(box.upper), tuple(stats), tuple(channel)



def _layer_state(upper: str) -> frozenset:
    """Every entry of a container's writable layer with its inode and ctime (any write changes it)."""
    state = set()
    for root, dirs, files in os.walk(upper):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            state.add((os.path.join(root, name), st.st_ino, st.st_ctime_ns))
    if not os.path.isdir(upper):
        raise FileNotFoundError(upper)
    return frozenset(state)

