"""The `local` fork engine: sandboxes are copy-on-write workspaces on this machine (paper:
Preliminaries, "forkable at horizon h"; the fork cost is Appendix "Rollout-Dispatch Cost Breakdown").

Each sandbox is an overlay workspace (crr.sandbox.overlay) over the task's cached base checkout, so
a snapshot copies only the diff and a restore is one mount: a fork costs milliseconds.

Every command runs in its own root: the minimal Debian that scripts/build-base-image.sh keeps at
CRR_ROOTFS (default DEFAULT_ROOTFS), read-only; crr's own interpreter and virtual environment read-only
at their host paths (so `python` and its pytest are the ones the agent always saw); the sandbox's
workspace at /testbed and its private /tmp (TMPDIR and HOME under /tmp/crr-sandbox); a fresh /proc and
a minimal /dev; nothing else of the host (no /root, no /work, no Docker socket, no /sys). The command
gets new PID, mount, IPC and UTS namespaces, an empty capability bounding set (no capability, none to
regain: no_new_privs), and its sandbox's network namespace (only loopback up): it cannot see a host
process, let alone enter its namespaces, and the base checkout below /testbed is not reachable at all.

How: the root is a mount namespace per sandbox, built once when the sandbox opens (on the spawner
thread, with mount(2) and pivot_root(2), no process: ~25 mounts), which each command's spawn enters
(setns) before `unshare --pid --mount-proc` and `setpriv` (util-linux, from the root filesystem) drop
into the command. Not bubblewrap, though it is the well-kept tool for this and works here: bwrap
builds the root per command, copying and tearing down the host's mount table each time, and a fork
(snapshot + restore + one command) cost 4.6x today's (323 against 71 ms p50, `crr fork bench`, one
session on a loaded 2-core host), against a budget of 2x; built once per sandbox, it costs 1.4x (79
against 56 ms p50, forks of the two engines taken in turn). The order of the steps (mounts private
first, binds, read-only remounts, the old root detached after pivot_root, capabilities dropped last,
in the command's own process) is bwrap's.

What each sandbox is held to as a whole (probed once per engine; what is missing is said at start):
- its writable state (the overlay's upper dir and /tmp) lives on a tmpfs of `disk_limit_mb`: writing
  more fails with ENOSPC;
- a memory cgroup (v1, under crr's own) of `mem_limit_mb` for all its processes together, and its
  tmpfs pages: over it the kernel's OOM killer ends a process of that sandbox. Commands are born in
  it: the spawner thread joins it for the spawn (moving a thread costs ~0.1 ms here);
- a network namespace per sandbox with only its own loopback up: no network, yet tests that serve
  on 127.0.0.1 work, and concurrent forks never contend for the same port. The one door is an engine
  made with `record_http=True` (the determinism filter's recording run, crr.sandbox.http): its
  sandboxes share the host's network and record their HTTP traffic;
- a pids cgroup per engine (`pids.max`, cgroup v1): a fork bomb hits the cap, not the machine
  (RLIMIT_NPROC counts all of the user's processes and is not enforced for root at all). Commands
  are born in it: they are spawned from one thread that joined it once. The same thread enters a
  sandbox's network namespace (setns) before spawning its command;
- per command: its own session; at the timeout its process group gets SIGTERM, then SIGKILL after a
  short grace; a PID namespace whose end (the command's shell ending or killed) kills everything it
  started; per-process RLIMIT_AS, RLIMIT_FSIZE (runaway files) and RLIMIT_CORE = 0.
A task with an environment (crr.sandbox.mirror) also gets its cached environment bound read-only at
/opt/crr, as its Docker image has it.

Where a piece cannot be had (no root filesystem, not root, no cgroup v1), the engine says
so when it is made and then runs only crr's own generated tasks (`OWN_REPOS`) unless it is told
`trust_task_code` (--trust-task-code): without its own root a command runs as this user on the host
file system, in the repository's host path.

The package, by concern: engine.py (LocalEngine: the ForkEngine protocol and what it probes when made),
sandbox.py (one sandbox: commands, files), containment.py (the root, the network namespace, spawning and
killing a command's processes), cgroups.py (pids and memory cgroups), reclaim.py (gc of what crashed
processes left), common.py (constants and the workdir).
"""

from crr.sandbox.local.common import DEFAULT_ROOTFS, OWN_REPOS, default_workdir, own_task
from crr.sandbox.local.engine import LocalEngine
from crr.sandbox.local.reclaim import gc_leftovers
from crr.sandbox.local.sandbox import LocalSandbox

__all__ = ["DEFAULT_ROOTFS", "OWN_REPOS", "LocalEngine", "LocalSandbox", "default_workdir", "gc_leftovers",
           "own_task"]
