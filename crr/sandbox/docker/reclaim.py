"""gc: what crashed crr runs left of the Docker engine (containers, snapshot images, engine directories and
their mounts), found by crr's labels and removed once their owner process is gone."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path

import docker
import docker.errors

from crr.sandbox.checkout import cache_root
from crr.sandbox.docker.common import OWNER, ROLE, _dispose_root, _owner_alive, docker_client
from crr.sandbox.overlay import mounts_under

log = logging.getLogger(__name__)


def gc(all: bool = False, dry_run: bool = False) -> list[str]:
    """Remove what crashed crr runs left: labelled containers and snapshot images whose owner
    process is gone, and engine directories (with their mounts) on this host; with `all`, also the
    per-task image cache. Nothing without crr's label is touched, nor anything a live process owns.
    Returns what was removed (with `dry_run`: what would be)."""
    api = docker_client(fix="start it (dockerd) to remove what crashed runs left in it").api
    done: list[str] = []
    for c in api.containers(all=True, filters={"label": f"{OWNER}=crr"}):
        if _owner_alive(c["Labels"]):
            continue
        done.append(f"container {c['Names'][0].lstrip('/')}")
        if not dry_run:
            with contextlib.suppress(docker.errors.NotFound):
                api.remove_container(c["Id"], force=True)
    images = [im for im in api.images(all=True, filters={"label": f"{OWNER}=crr"})
              if ((im.get("Labels") or {}).get(ROLE) == "snapshot" and not _owner_alive(im["Labels"]))
              or ((im.get("Labels") or {}).get(ROLE) == "task" and all)]
    return done + _remove_images(api, images, dry_run) + _gc_host(all, dry_run)


def _remove_images(api: docker.APIClient, images: list[dict], dry_run: bool = False) -> list[str]:
    """Remove images newest first and by tag, so that a parent snapshot is only untagged and goes
    with its last child; one in use by a container is left (and logged). Returns what went."""
    done: list[str] = []
    for im in sorted(images, key=lambda i: -i["Created"]):
        tags = [t for t in im.get("RepoTags") or [] if t != "<none>:<none>"]
        for ref in tags or [im["Id"]]:
            try:
                if not dry_run:
                    api.remove_image(ref)
                done.append(f"image {ref if tags else ref[7:19]}")
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                log.info("left image %s: %s", ref, e.explanation)
    return done


def _gc_host(all: bool, dry_run: bool) -> list[str]:
    """Engine directories of dead owners (found in the cache and, for other cache roots, by their
    mounts), mounts first; with `all`, also the /testbed trees extracted from images."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    roots = {Path(p[:p.index("/crr-docker-")]) / p[p.index("/crr-docker-") + 1:].split("/")[0]
             for p in points if "/crr-docker-" in p}
    here = cache_root() / "docker"
    roots |= set(here.glob("crr-docker-*")) if here.is_dir() else set()
    done: list[str] = []
    for root in sorted(roots):
        try:
            labels = json.loads((root / "owner.json").read_text())
        except (OSError, ValueError):
            continue  # not an engine dir, or one being made right now
        if _owner_alive(labels):
            continue
        done += [f"mount {m}" for m in mounts_under(root)] + [f"dir {root}"]
        if not dry_run:
            _dispose_root(root)
    extracted = cache_root() / "docker-testbed"
    if all and extracted.is_dir():
        done.append(f"dir {extracted}")
        if not dry_run:
            shutil.rmtree(extracted, ignore_errors=True)
    return done
