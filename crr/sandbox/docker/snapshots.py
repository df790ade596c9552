"""Snapshots of Docker sandboxes, both modes (package doc): commit (`docker commit` into a labelled image,
flattened before overlay2's layer limit) and overlay (a copy of the workspace's upper layer), and the
count of sandboxes restored from each, so that a released snapshot goes with its last user."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import requests

from crr.sandbox.base import Snapshot, TaskSpec
from crr.sandbox.docker.common import (_MS_BIND, REPO_DIR, ROLE, SNAPSHOT_REPO, TASK, _dispose_root, _label_changes,
                                       _mount_call)
from crr.sandbox.docker.sandbox import DockerSandbox
from crr.sandbox.overlay import Layer, OverlayWorkspace, mount_tmpfs

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A snapshot this engine holds: its image (commit) or overlay layer, and who still needs it."""

    task: TaskSpec
    image: str           # commit: the snapshot image; overlay: the image the pool runs
    depth: int = 0       # commit: image layers, for the flatten guard
    layer: Layer | None = None
    users: int = 0       # open sandboxes restored from it
    released: bool = False


class Snapshots:
    """Methods of DockerEngine (its mode, _held, api, root)."""

    def _commit_sandbox(self, task: TaskSpec, image: str, depth: int, snapshot_id: str | None = None
                        ) -> DockerSandbox:
        box = self._run(image, {ROLE: "sandbox", TASK: task.instance_id})
        return self._register(DockerSandbox(self, task, box, image, depth=depth, snapshot_id=snapshot_id))

    def _snapshot(self, sb: DockerSandbox) -> Snapshot:
        sid = f"{self.id}-{next(self._seq)}"
        if self.mode == "commit":
            held = _Held(sb.task, f"{SNAPSHOT_REPO}:{sid}")
            labels = _label_changes({**self.labels, ROLE: "snapshot", TASK: sb.task.instance_id})
            if sb.depth + 1 > self.flatten_depth:
                self._flatten(sb, sid, labels)
            else:
                with sb._call("commit the container"):
                    self.api.commit(sb.box.id, SNAPSHOT_REPO, sid, changes=labels)
            held.depth = self._layers(held.image)
            handle = {"image": held.image, "depth": held.depth}
        else:
            held = _Held(sb.task, sb.image, layer=sb.workspace.snapshot(self.root / "layers" / sid))
            handle = {"layer": str(held.layer.path), "image": sb.image}
        with self._lock:
            self._held[sid] = held
        return Snapshot(id=sid, engine=self.name, task_id=sb.task.instance_id, handle=handle)

    def _flatten(self, sb: DockerSandbox, sid: str, labels: list[str]) -> None:
        """Export the container's file system and import it as a one-layer image, keeping its
        environment and workdir: the cure for overlay2's ~125-layer limit on commit chains."""
        log.info("flattening %s (%d layers) into %s:%s", sb.name, sb.depth, SNAPSHOT_REPO, sid)
        with sb._call("flatten the container"):
            env = self.api.inspect_container(sb.box.id)["Config"].get("Env") or []
            changes = [f"ENV {k}={json.dumps(v)}" for k, _, v in (e.partition("=") for e in env)]
            self.api.import_image_from_data(self.api.export(sb.box.id), repository=SNAPSHOT_REPO,
                                            tag=sid, changes=[*changes, f"WORKDIR {REPO_DIR}", *labels])

    def _unuse(self, sid: str, drop: int = 1) -> None:
        """A sandbox restored from `sid` closed (drop=1) or `sid` was released (drop=0): free the
        snapshot's image or layer once it is released and unused."""
        with self._lock:
            held = self._held.get(sid)
            if held is None:
                return
            held.users -= drop
            if not held.released or held.users > 0:
                return
            del self._held[sid]
        if held.layer is not None:
            held.layer.release()
            return
        try:  # by tag: a parent of a live child snapshot is only untagged, and pruned with the child
            self.api.remove_image(held.image)
        except (docker.errors.DockerException, requests.RequestException) as e:
            log.warning("could not remove snapshot image %s: %s (crr sandbox gc will)", held.image, e)

    def _overlay_sandbox(self, task: TaskSpec, image: str, make_workspace: Callable[[Path], OverlayWorkspace],
                         snapshot_id: str | None = None) -> DockerSandbox:
        box = self._take_warm(image)
        ws, scratch = None, self.root / "ws" / box.name
        try:
            scratch.mkdir()
            mount_tmpfs(scratch, self.disk_limit_mb)  # the workspace's writes, capped
            ws = make_workspace(scratch / "ws")
            # Mounted onto the slot, the workspace propagates into the running container's /testbed.
            _mount_call(str(ws.tree), str(box.slot), _MS_BIND)
        except BaseException:
            if ws is not None:
                ws.close()
            _dispose_root(scratch)
            self._background.submit(self._discard, box)
            raise
        return self._register(DockerSandbox(self, task, box, image, snapshot_id=snapshot_id, workspace=ws))
