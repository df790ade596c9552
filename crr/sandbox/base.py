"""The sandbox and fork-engine protocol (paper: Preliminaries, "forkable at horizon h").

A sandbox holds one task's repository and runs commands in its root. Its state is the file system:
tools are stateless per command (no shell session survives between actions, as in mini-swe-agent),
so a snapshot of the working tree is an exact snapshot of the environment, and restoring it gives
an independent sandbox whose writes never reach the parent or its siblings.

    with engine.start(task) as sb:            # fresh sandbox at task.base_commit
        sb.exec("python -m pytest -q", timeout=60)
        snap = sb.snapshot()                  # sigma(s_t)
        with engine.restore(snap) as fork:    # rho(sigma(s_t)): an independent copy
            fork.exec("...")
        engine.release(snap)                  # frees what the snapshot holds
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Protocol, Self, runtime_checkable

from crr.errors import CRRError, SandboxError

# Scratch files that crr itself writes inside a sandbox live in the git directory: git never
# tracks them, the tree digest skips them, and no engine has to expose a path outside the repo.
SCRATCH_DIR = ".git/crr"

# Observations and command outputs are bounded: a command that prints forever yields this many
# bytes of output (head and tail kept) and a flag, never an unbounded string.
MAX_OUTPUT_BYTES = 64 * 1024


class BoundedOutput:
    """A command's output kept within `limit` bytes: the first and last `limit // 2` bytes survive.

    Feed it every chunk as it arrives (keep draining a flood; don't stop reading), then take `text()`.
    """

    def __init__(self, limit: int = MAX_OUTPUT_BYTES):
        self.half = limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[:-self.half]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {cut} bytes of output truncated ...]\n".encode() if cut else b""
        return bytes(self.head + marker + self.tail).decode("utf-8", errors="replace")


class TaskSpec(Protocol):
    """What the sandbox layer reads of a task: crr.tasks.schema.Task is one (sandbox never imports it).
    Where the repository comes from is a task source's business (crr.tasks.sources), which gets the
    whole task object; an engine reads these fields."""

    @property
    def instance_id(self) -> str: ...

    @property
    def base_commit(self) -> str: ...

    @property
    def image(self) -> str | None: ...        # a Docker image with the repository at /testbed

    @property
    def mirror(self) -> dict | None: ...      # the hash-pinned lock of the environment (crr.sandbox.mirror)

    @property
    def http_replay(self) -> dict | None: ...  # the recorded HTTP cassette (crr.sandbox.http)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int          # 124 when the command hit its timeout (like coreutils `timeout`)
    output: str             # stdout and stderr interleaved, decoded with errors="replace", bounded
    timed_out: bool = False
    truncated: bool = False  # output exceeded MAX_OUTPUT_BYTES and was cut
    duration_s: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """A handle on a sandbox's file-system state; `engine` can restore it any number of times."""

    id: str
    engine: str
    task_id: str
    handle: dict = field(default_factory=dict, compare=False)  # engine-private (paths, image ids)


class ClosingSandbox:
    """What the local and Ray sandboxes share: `with` closes them, and a closed one refuses calls."""
    task: TaskSpec
    _closed: bool

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether close() has begun: a call that fails now fails because its owner is shutting down."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise CRRError(f"sandbox of {self.task.instance_id} is closed")


@runtime_checkable
class Sandbox(Protocol):
    task: TaskSpec
    repo_dir: str  # the repository root as commands see it (e.g. /testbed in Docker)

    def exec(self, command: str, timeout: float = 60.0) -> ExecResult:
        """Run `command` with bash in the repository root; kill its whole process tree at `timeout`."""

    def read_file(self, path: str) -> bytes:
        """Bytes of `path` (relative to the repository root); CRRError if outside it or missing."""

    def write_file(self, path: str, data: bytes) -> None:
        """Write `path` (relative to the repository root), creating missing parent directories;
        CRRError if it resolves outside it."""

    def snapshot(self) -> Snapshot: ...

    def close(self) -> None:
        """Free everything this sandbox holds; idempotent."""

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc) -> None: ...


@runtime_checkable
class ForkEngine(Protocol):
    name: str

    def start(self, task: TaskSpec) -> Sandbox: ...

    def restore(self, snapshot: Snapshot) -> Sandbox: ...

    def release(self, snapshot: Snapshot) -> None:
        """Drop a snapshot; its resources go when the last sandbox restored from it closes."""

    def close(self) -> None:
        """Close every sandbox and snapshot this engine still holds; idempotent."""


# A content digest of the working tree (paths, modes, bytes; .git excluded), computed inside the
# sandbox so that it means the same on every engine. Used to check that a restore is exact.
_DIGEST_SCRIPT = r"""
import hashlib, os, stat, sys
h = hashlib.sha256()
for root, dirs, files in os.walk('.', followlinks=False):
    dirs[:] = sorted(d for d in dirs if not (root == '.' and d == '.git'))
    for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
        p = os.path.join(root, name)
        st = os.lstat(p)
        h.update(p.encode('utf-8', 'surrogateescape') + b'\0' + oct(stat.S_IMODE(st.st_mode)).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(b'L' + os.readlink(p).encode('utf-8', 'surrogateescape'))
        elif stat.S_ISREG(st.st_mode):
            with open(p, 'rb') as f:
                h.update(b'F' + hashlib.sha256(f.read()).digest())
    for d in dirs:
        h.update(os.path.join(root, d).encode('utf-8', 'surrogateescape') + b'\0D')
print(h.hexdigest())
"""


def tree_digest(sandbox: Sandbox, python: str = "python3") -> str:
    """SHA-256 over the sandbox's working tree: equal digests mean an exact restore."""
    res = sandbox.exec(f"{python} -c {shlex.quote(_DIGEST_SCRIPT)}", timeout=120)
    if res.exit_code != 0:
        raise SandboxError(f"tree digest failed in {sandbox.task.instance_id}: {res.output[-300:]}")
    return res.output.strip().splitlines()[-1]
