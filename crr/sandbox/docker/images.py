"""The images a Docker sandbox starts from: the base image, a task's `crr-task:<key>` (base + checkout) and
`crr-env:<key>` (base + the task's environment), and /testbed extracted from a task's own image."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import docker.errors

from crr.errors import SandboxError
from crr.sandbox import mirror
from crr.sandbox.base import TaskSpec
from crr.sandbox.checkout import base_checkout, cache_root, publish
from crr.sandbox.docker.common import (ENV_REPO, REPO_DIR, ROLE, TASK, TASK_REPO, _docker_errors, _label_changes,
                                       _root_owned)

log = logging.getLogger(__name__)


class Images:
    """Methods of DockerEngine (its api, client, labels, base_image)."""

    def _require_image(self, image: str, task: TaskSpec) -> dict:
        with _docker_errors(f"inspect image {image}"):
            try:
                return self.api.inspect_image(image)
            except docker.errors.ImageNotFound:
                how = ("build it with scripts/build-base-image.sh" if image == self.base_image
                       else f"it is task {task.instance_id}'s image: build or load it on this machine")
                raise SandboxError(f"Docker image {image} is not present; {how} (crr never pulls images)") from None

    def _layers(self, image: str) -> int:
        with _docker_errors(f"inspect image {image}"):
            return len(self.api.inspect_image(image)["RootFS"]["Layers"])

    def _task_image(self, task: TaskSpec) -> str:
        """The image a commit-mode sandbox of `task` starts from: the task's own image, or the base
        (or env) image plus the base checkout at /testbed, committed once as a cached `crr-task:<key>`."""
        if task.image:
            self._require_image(task.image, task)
            return task.image
        base = self._env_image(task)
        base_id = self._require_image(base, task)["Id"]
        checkout = base_checkout(task)
        # Keyed by content (base image, commit), so tasks and runs with the same commit share it.
        key = hashlib.sha256(f"{base_id}\0{task.base_commit}".encode()).hexdigest()[:16]
        tag = f"{TASK_REPO}:{key}"
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.api.inspect_image(tag)
            return tag
        log.info("building %s for task %s from %s", tag, task.instance_id, checkout)
        with _docker_errors(f"build the image of task {task.instance_id}"):
            container = self.client.containers.create(base, entrypoint=["true"], network_mode="none",
                                                      labels={**self.labels, ROLE: "build"})
            try:  # a container that never starts takes the files, and commit makes them an image
                with tempfile.TemporaryFile() as buf:
                    with tarfile.open(fileobj=buf, mode="w") as tar:
                        tar.add(checkout, arcname=REPO_DIR.lstrip("/"), filter=_root_owned)
                    buf.seek(0)
                    container.put_archive("/", buf)
                container.commit(TASK_REPO, key, changes=[f"WORKDIR {REPO_DIR}", *_label_changes(
                    {ROLE: "task", TASK: task.instance_id})])
            finally:
                container.remove(force=True)
        return tag

    def _env_image(self, task: TaskSpec) -> str:
        """The image for a task's sandboxes (before /testbed): the base image, or for a task with an
        environment the base plus /opt/crr installed from the wheelhouse with no network, committed
        once as a cached `crr-env:<key>` (keyed by the base image and the environment)."""
        if not task.mirror:
            return self.base_image
        lines = task.mirror["requirements"]
        base_id = self._require_image(self.base_image, task)["Id"]
        key = hashlib.sha256(f"{base_id}\0{mirror.environment_key(lines)}".encode()).hexdigest()[:16]
        tag = f"{ENV_REPO}:{key}"
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.api.inspect_image(tag)
            return tag
        log.info("building %s (lock %s) for task %s", tag, mirror.digest(lines)[:12], task.instance_id)
        script = mirror.install_script(mirror.ENV_ROOT, "/usr/bin/python3")
        with tempfile.TemporaryDirectory() as staged, _docker_errors(f"build the environment of task "
                                                                     f"{task.instance_id}"):
            mirror.stage(lines, Path(staged) / "crr")
            container = self.client.containers.create(self.base_image, entrypoint=["bash", "-c", script],
                                                      network_mode="none", labels={**self.labels, ROLE: "build"})
            try:
                with tempfile.TemporaryFile() as buf:
                    with tarfile.open(fileobj=buf, mode="w") as tar:
                        tar.add(Path(staged) / "crr", arcname=mirror.ENV_ROOT.lstrip("/"), filter=_root_owned)
                    buf.seek(0)
                    container.put_archive("/", buf)
                container.start()
                status = container.wait(timeout=mirror.PIP_TIMEOUT_S)["StatusCode"]
                if status != 0:
                    logs = container.logs().decode("utf-8", errors="replace")
                    raise SandboxError(f"installing the environment of task {task.instance_id} in {self.base_image} "
                                       f"failed (exit {status}):\n{logs[-2000:]}")
                container.commit(ENV_REPO, key, changes=_label_changes({ROLE: "task", TASK: task.instance_id}))
            finally:
                container.remove(force=True)
        return tag

    def _image_testbed(self, image: str) -> Path:
        """/testbed of an image, extracted once into the cache: the overlay lower dir of a task that
        comes as an image."""
        image_id = self.api.inspect_image(image)["Id"].split(":")[-1][:16]
        dest = cache_root() / "docker-testbed" / image_id
        if dest.is_dir():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{image_id}."))
        try:
            with _docker_errors(f"read {REPO_DIR} from image {image}"):
                container = self.client.containers.create(image, entrypoint=["true"], network_mode="none",
                                                          labels={**self.labels, ROLE: "build"})
                try:
                    stream, _ = container.get_archive(REPO_DIR)
                    # GNU tar rather than tarfile: it keeps owners, modes, links and special files
                    # exactly, and takes the stream as it arrives.
                    tar = subprocess.Popen(["tar", "-x", "-p", "--same-owner", "-C", str(tmp)],
                                           stdin=subprocess.PIPE, stderr=subprocess.PIPE)
                    for chunk in stream:
                        tar.stdin.write(chunk)
                    _, err = tar.communicate()
                    if tar.returncode != 0:
                        raise SandboxError(f"extracting {REPO_DIR} of {image} failed: {err.decode()[-300:]}")
                finally:
                    container.remove(force=True)
            publish(tmp / REPO_DIR.lstrip("/"), dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest
