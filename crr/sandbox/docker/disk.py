"""Commit mode without a quota: the disk watch of a container's writable layer (package doc), and the kill
of an action's processes from the host that stops an action past the cap."""

from __future__ import annotations

import contextlib
import logging
import os
import time

import docker.errors

from crr.sandbox.docker.common import _docker_errors

log = logging.getLogger(__name__)

LAYER_POLL_S = 0.05  # commit mode without a quota: how often a running action's disk use is measured
_INODE_BYTES = 256  # charged per file on top of its blocks, so that a million empty files count (ext4's inode)
_FULL_SLACK = 1 << 20  # commit mode, layer over the cap: what an action may still add (empty files) unstopped
_MEASURE_EVERY = 10  # commit mode, watched: the layer is walked after at most this many actions


class DiskWatch:
    """The disk cap of a watched layer, as methods of a DockerSandbox (its box.watch, engine.disk_limit_mb)."""

    def _measure(self) -> int:
        """The watched paths' disk use in bytes, now."""
        self.disk_used = _disk_use(self.box.watch)
        self._written, self._unmeasured = _written(self._pid1()), 0
        return self.disk_used

    def _after_action(self, cap: int, stopped: bool) -> int:
        """The watched use once an action ended: measured (a walk costs ~5-20 us a file of the layer),
        unless the container's processes cannot have written enough since the last measurement to pass
        the cap. Their bytes written come from PID 1's /proc io, which folds in every process it reaped
        (the action's, and the orphans it started); what that does not count (empty files and dirs,
        Docker's own writes, an orphan killed but not yet reaped) is measured by the walk at least every
        _MEASURE_EVERY actions, and by the polls of any action longer than LAYER_POLL_S."""
        self._unmeasured += 1
        if (stopped or self.disk_used > cap or self._unmeasured >= _MEASURE_EVERY
                or self.disk_used + _written(self._pid1()) - self._written > cap):
            return self._measure()
        return self.disk_used

    def _disk_full_notice(self, stopped: bool) -> bytes:
        what = ("the command was stopped" if stopped else
                "until it is back under the cap, files can be deleted, not written")
        return (f"\n[crr: No space left on device: this sandbox has written {self.disk_used / 2**20:.0f} MB outside "
                f"/tmp, past its disk cap of {self.engine.disk_limit_mb} MB; {what}]\n").encode()


class LayerCap:
    """The engine's side of the cap on a commit-mode container's writable layer: a quota where the storage
    driver takes one, else the paths the disk watch measures (methods of DockerEngine)."""

    def _create(self, image: str, settings: dict):
        """Create a container; in commit mode with a quota on its writable layer where the storage
        driver takes one (asked once: the daemon refuses `size` unless overlay2 sits on xfs with pquota)."""
        if self.mode == "commit" and self._layer_quota is not False:
            try:
                container = self.client.containers.create(
                    image, storage_opt={"size": f"{self.disk_limit_mb}M"}, **settings)
                self._layer_quota = True
                return container
            except docker.errors.APIError as e:
                if self._layer_quota or "storage-opt" not in str(e).lower():
                    raise
                self._layer_quota = False
                log.info(f"the Docker storage driver takes no quota here ({e.explanation or e}): the engine "
                         f"watches each container's writable layer instead (cap {self.disk_limit_mb} MB)")
        return self.client.containers.create(image, **settings)

    def _watched(self, container) -> tuple[str, ...]:
        """Commit mode: the paths the disk watch measures (package doc): the container's upper dir and
        the /etc/hosts-like files Docker binds in from its own directory. None where a quota caps the
        layer, or where the layer cannot be read (not root: warned once)."""
        upper = container.attrs["GraphDriver"]["Data"].get("UpperDir", "")
        if self._layer_quota:
            return ()
        if not (upper and os.access(upper, os.R_OK | os.X_OK)):
            if not self._warned_unwatched:
                self._warned_unwatched = True
                log.warning(f"the writable layers of this docker engine's containers cannot be watched "
                            f"({upper or 'no upper dir'} is not readable: run as root): they are capped per file "
                            f"({self.fsize_limit_mb} MB) only; their /tmp at {self.disk_limit_mb} MB")
            return ()
        if self._docker_root is None:
            with _docker_errors("ask the daemon for its root directory"):
                self._docker_root = self.client.info()["DockerRootDir"]
        own = f"{self._docker_root}/containers/{container.id}"
        return upper, f"{own}/hosts", f"{own}/hostname", f"{own}/resolv.conf"


def _disk_use(paths: tuple[str, ...]) -> int:
    """Bytes on disk of `paths` and everything under them (not following links): blocks allocated
    (ext4 counts delayed allocation) plus an inode each, so that empty files count too."""
    total, stack = 0, list(paths)
    while stack:
        path = stack.pop()
        try:
            entries = os.scandir(path)
        except NotADirectoryError:
            with contextlib.suppress(OSError):
                total += os.lstat(path).st_blocks * 512 + _INODE_BYTES
            continue
        except OSError:  # gone (removed while we looked)
            continue
        with entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512 + _INODE_BYTES
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
    return total


def _written(pid: int) -> int:
    """Bytes `pid` and the children it reaped made dirty in the page cache of a disk (write_bytes of
    /proc/PID/io: tmpfs does not count); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))
    except (OSError, StopIteration):
        return 0


def _kill_namespace(pid1: int, rounds: int = 50) -> bool:
    """SIGKILL, from the host, every process in the PID namespace of `pid1` but `pid1` itself (what
    `kill -9 -1` inside does), again until none is left (a fork may race the first pass); True once
    none is. False if the namespace cannot be read (PID 1 gone, or not root)."""
    try:
        ns = os.readlink(f"/proc/{pid1}/ns/pid")
    except OSError:
        return False
    for _ in range(rounds):
        victims = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != pid1:
                with contextlib.suppress(OSError):  # exited, or a zombie (its namespaces are gone)
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        victims.append(int(entry))
        if not victims:
            return True
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, 9)
        time.sleep(0.001)
    return False

