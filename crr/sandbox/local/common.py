"""What the local engine's parts share: its constants, the workdir, and warnings said once."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

from crr.sandbox.base import TaskSpec
from crr.sandbox.checkout import cache_root

log = logging.getLogger(__name__)


OWNER_FILE = "crr-owner.json"  # marks an engine dir as crr's and names the process that owns it
_PREFIX = "crr-engine-"
_GRACE_S = 0.5  # between SIGTERM and SIGKILL at a timeout
CGROUP_REMOVE_S = 5.0  # how long closing an engine waits for its pids cgroup to empty
FIXED_REPO_DIR = "/testbed"  # where commands see the repository, as in SWE-bench images
FIXED_TMP_DIR = "/tmp/crr-sandbox"  # and their scratch space (TMPDIR, HOME)
DEFAULT_ROOTFS = "/var/lib/crr/rootfs"  # where scripts/build-base-image.sh keeps the sandbox root
# crr's own generated tasks (crr tasks micro, the nano tier, the fork benchmark's repository): the
# only ones an engine that cannot contain task code runs without --trust-task-code.
OWN_REPOS = ("crr/nano", "micro/", "synthetic/fork-bench")
_ROOT_FRESH = ("proc", "dev", "tmp", "sys")  # of the root's top-level dirs: made per sandbox (sys: not at all)
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # bound into each sandbox's /dev
# Run inside the sandbox's root (the root filesystem's util-linux): new PID (its PID 1 the rlimit sh,
# killed with everything under it when the command ends), IPC and UTS namespaces, a mount namespace for a
# /proc of that PID namespace; then no capability and no way to regain one.
_ENTER = ["/usr/bin/unshare", "--pid", "--ipc", "--uts", "--kill-child", "--mount-proc", "--",
          "/usr/bin/setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--"]
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CLONE_NEWNET, _CLONE_NEWNS, _CLONE_FS, _SIOCSIFFLAGS, _IFF_UP = 0x40000000, 0x20000, 0x200, 0x8914, 0x1
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = (
    0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000, 0x40000)
_MNT_DETACH = 2


_warned: set[str] = set()


def default_workdir() -> Path:
    return cache_root() / "sandboxes"


def own_task(task: TaskSpec) -> bool:
    """Is `task` one of crr's own generated tasks (OWN_REPOS), with no environment of its own?"""
    repo = getattr(task, "repo", "")
    return (any(repo == r or (r.endswith("/") and repo.startswith(r)) for r in OWN_REPOS)
            and not task.mirror and not task.image)


def _warn_once(message: str, key: str | None = None) -> None:
    if (key or message) not in _warned:
        _warned.add(key or message)
        log.warning(message)
