"""Docker fork engines (paper: Preliminaries, "forkable at horizon h"; Appendix "Rollout-Dispatch
Cost Breakdown", where fork/materialisation is CRR's largest overhead, about 141 ms per fork).

The sandbox state is the repository at /testbed; tools are stateless per command. Two ways to fork it:

  commit   the paper's engine. snapshot = `docker commit` of the container into a labelled image,
           restore = a new container from that image. Exact for the whole container file system
           (installed packages too), but every fork pays a container start, and every generation adds
           an image layer, so long fork-of-fork chains are flattened (export + import) before
           overlay2's limit of about 125 layers.
  overlay  /testbed is a host overlayfs workspace (crr.sandbox.overlay) bind-mounted into a warm,
           pooled container. The pool's /testbed is fed from a host slot directory on a shared mount,
           so a workspace mounted onto the slot appears inside the already running container: a fork
           is a copy of the small upper layer plus two mounts, with no container start and no image.
           Only /testbed is forked; a container returns to the pool only if the rest of its file
           system is exactly as fresh (see fresh_state), else it is removed.

Commands do not go through `docker exec`: its runc round trip costs ~50 ms, more than a whole
overlay fork. PID 1 of every container is a small shell loop that runs action scripts handed to it
through a FIFO in a host directory bind-mounted at /run/crr, and streams their output back through
another FIFO (~10 ms an action). Every container has no network, memory/CPU/pid limits, and the labels
org.crr.owner=crr + engine id + owner pid, so `gc()` finds what crashed runs left, and only crr's.
What a container writes is capped, in both modes: every file at `fsize_limit_mb` (RLIMIT_FSIZE), the
log of PID 1's output (which a command can reach through /proc/1/fd/1) at 1 MB, /dev and /dev/shm at
Docker's 64 MB tmpfs each, the command channel at /run/crr (host side) on a tmpfs of CTL_TMPFS_MB (run
as root), and the rest as follows.

  overlay  the container's root is read-only. What stays writable is on tmpfs mounts the engine makes on
           the host: /testbed's workspace (per sandbox) and one scratch tmpfs per container bound at
           /tmp, HOME (/root) and /var/tmp, each at `disk_limit_mb` (ENOSPC past it). Writing anywhere
           else fails with EROFS, so `pip install` into the image's site-packages or /opt/crr/env is
           refused, as on the local engine. A container goes back to the pool only if all of it is as
           fresh as it started (_fresh_state).
  commit   the whole file system is the state (`docker commit` snapshots it), so the root stays
           writable. Where the storage driver takes a quota (`--storage-opt size=`: overlay2 on xfs with
           pquota) the writable layer gets one of `disk_limit_mb`. Elsewhere (overlay2 on ext4, as
           here) the engine, as root, watches the disk use of the container's upper dir and its
           /etc/hosts-like files while an action runs (every LAYER_POLL_S, or on a big layer 10x the
           last walk's cost up to 1 s: a walk costs ~5-20 us a file here; and when it ends, see
           _after_action): past `disk_limit_mb` it kills the action's processes from the host (a few
           ms) and the observation says "No space left on device". It overshoots by what the action
           writes in one poll interval plus the walk and the kill: 0.05 s x the write speed for a few
           big files (~0 here), up to ~1.5 s of writing for ~20,000 small ones (1.5-2.1x a 64 MB cap in
           4 KB files under load; docs/sandboxes.md has the figures). Until the layer is back under the
           cap, every action runs with RLIMIT_FSIZE 0, as on a full disk (deleting works, writing fails
           with "File too large"), and is stopped if it still adds more than _FULL_SLACK (empty files), so
           short actions cannot pile up past the cap.
           /tmp is a tmpfs of `disk_limit_mb` (never committed). The cap is per container, as a quota
           is: a snapshot's files move into its image, and a fork of it starts with an empty layer.
           Not root (the upper dir unreadable): the engine warns once and the layer is capped per file.

The one door is an engine made with `record_http=True` (the determinism filter's recording run,
crr.sandbox.http): its containers share the host's network and record their HTTP traffic.

A task with an environment (crr.sandbox.mirror) runs on a `crr-env:<key>` image instead of the base
image: the base plus /opt/crr (lock, wheelhouse, venv), installed by a container with no netwo

The package, by concern: common.py (labels, the client, the command channel's scripts), sandbox.py (one
container: commands, files, health), disk.py (the writable layer's disk watch and the kill from the host),
engine.py (DockerEngine: the ForkEngine protocol, containers), images.py (base, task and environment
images), snapshots.py (commit and overlay snapshots), pool.py (overlay mode's warm containers) and
reclaim.py (gc of what crashed runs left).
"""

from crr.sandbox.docker.common import DEFAULT_BASE_IMAGE, TESTBED_ENV, docker_client
from crr.sandbox.docker.engine import DockerEngine
from crr.sandbox.docker.reclaim import gc

__all__ = ["DEFAULT_BASE_IMAGE", "TESTBED_ENV", "DockerEngine", "docker_client", "gc"]
