"""Versioned run directories: every command reads and writes one.

Layout: ``<root>/<UTC timestamp>-<command>-<name>/`` with ``config.yaml``, ``manifest.json``,
append-only ``metrics.jsonl`` and the command's outputs. Whole-file writes are atomic (temp file +
rename) and JSONL appends are flushed and fsynced per record, so a crash loses at most the record in
flight and never corrupts what was written before.

A run directory has one writer at a time: `create` and `open(..., write=True)` take an advisory lock
(flock on LOCK_FILE) that the process holds until `release_locks()` (the CLI calls it when a command
ends) or its death, when the kernel drops it (SIGKILL included), so no stale lock outlives a crash.
Readers (`open(path)`: reports, replay verification, evaluating a run's checkpoints) take no lock.

A run file that is missing or corrupt (`read_run_file`, `read_jsonl`), or a write the disk refuses (full,
read-only, no permission: `OUTPUT_ERRNOS`), is one line naming the file: a CRRError, or an OSError whose
filename is the file (the CLI prints it as one line).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from crr import __version__
from crr.errors import CRRError

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("results/runs")
_TRACKED_PACKAGES = ("torch", "transformers", "trl", "peft", "swebench", "docker", "datasets")
LOCK_FILE = ".lock"  # flock'ed by the run's writer; holds its pid and command while it lives
RUN_LOG = "crr.log"  # what libraries said while a command wrote the run (the CLI routes them there)
_locks: dict[Path, int] = {}  # run directory (resolved) -> fd of the lock this process holds
# Called with a run directory when this process becomes its writer: the CLI points its run log there.
writer_hooks: list[Callable[[Path], None]] = []
# The errors of a write that the machine refuses (disk full, quota, read-only, no permission): the user's to fix.
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})
# A path given to a command that cannot be what it names: an --out that is a file (or lies under one), a file
# where a directory is wanted, a name too long. The user's to fix, like OUTPUT_ERRNOS, but no resume helps.
PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG})


def _refused(path: Path, e: OSError) -> OSError:
    """The OSError `e` of writing `path`, naming `path` itself (not a temporary sibling)."""
    return OSError(e.errno, e.strerror, str(path)) if e.errno in OUTPUT_ERRNOS else e


def lock_run(path: Path, command: str) -> None:
    """Make this process the one writer of the run directory `path` (a no-op if it already is); a
    CRRError naming the owner if another live process is."""
    key = Path(path).resolve()
    if key in _locks:
        return
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:   # a read-only or full disk
        raise _refused(key / LOCK_FILE, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:  # being written right now
            owner = {}
        finally:
            os.close(fd)
        who = (f"crr process {owner['pid']} (`crr {owner.get('command', '?')}` on {owner.get('host', '?')})"
               if "pid" in owner else "another crr process")
        raise CRRError(f"{path} is in use by {who}: a run directory has one writer at a time; wait for it to "
                       "end or stop it, then resume") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": command, "host": socket.gethostname()}).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise _refused(key / LOCK_FILE, e) from None
    _locks[key] = fd
    for hook in list(writer_hooks):  # a hook may remove itself
        hook(key)


def release_locks() -> None:
    """Give up every run directory this process writes (their lock files are left, emptied)."""
    while _locks:
        _, fd = _locks.popitem()
        os.ftruncate(fd, 0)
        os.close(fd)  # drops the flock


_UMASK = os.umask(0o022)   # read once (umask can only be read by setting it), at import, before any thread
os.umask(_UMASK)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a torn one. The file gets
    the mode a plain one gets under the umask, not the temporary file's owner-only 0600."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise _refused(path, e) from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _refused(path, e) from None
        raise


def as_made(run_path: Path | str, value: str | None) -> str | None:
    """A relative path a run's files name, seen from here. Run files keep paths as they were given (so that
    committed runs name no machine's directories); resumed from another directory, such a path is read from the
    nearest ancestor of the run directory under which it exists: the directory the run was started in. A value
    that is absolute, exists here or exists under no ancestor (a hub id, a task set's name) is returned as it is."""
    if not value or Path(value).is_absolute() or Path(value).exists():
        return value
    base = next((b for b in Path(run_path).resolve().parents if (b / value).exists()), None)
    return value if base is None else os.path.relpath(base / value)


def relative_to_cwd(path: Path | str) -> str | None:
    """How a command or a committed file should name `path`: relative to the working directory, so that it
    works from a fresh clone and names no machine; None when it lies outside (a relative path is as given)."""
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return None


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record and make it durable before returning.

    A torn last record (a crash mid-append; read_jsonl skips it) is cut first, so that the new record
    starts on a line of its own instead of being glued to the fragment.
    """
    line = json.dumps(record, sort_keys=True, default=str)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size and (f.seek(size - 1), f.read(1))[1] != b"\n":
                f.seek(0)
                keep = f.read().rfind(b"\n") + 1
                log.warning("%s: dropping a torn last record (%d bytes) left by an interrupted run", path, size - keep)
                f.truncate(keep)
            start = f.seek(0, os.SEEK_END)
            rest = memoryview(line.encode("utf-8") + b"\n")
            try:   # past f's buffer: a write the disk takes part of leaves nothing there for the cut to flush again
                while rest:
                    rest = rest[os.write(f.fileno(), rest):]
                os.fsync(f.fileno())
            except OSError:   # the disk took part of it: cut it back, so the log ends on a whole record
                os.ftruncate(f.fileno(), start)
                raise
    except OSError as e:
        raise _refused(path, e) from None


def read_jsonl(path: Path) -> Iterator[dict]:
    """Records of an append-only log; a torn last line (a crash mid-append) is skipped; any other line that is
    not a JSON object is a CRRError naming path:line."""
    if not path.exists():
        return
    lines = path.read_bytes().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):   # (JSONDecodeError is a ValueError)
            if i == len(lines) - 1 and line.lstrip().startswith(b"{"):
                return  # the record in flight when the writer died
            raise CRRError(f"{path}:{i + 1}: corrupt JSON record in an append-only log") from None
        if not isinstance(record, dict):
            raise CRRError(f"{path}:{i + 1}: a {type(record).__name__}, not a JSON object, in an append-only log")
        yield record


def read_run_file(path: Path, parse: Callable[[str], Any] = json.loads, what: str = "JSON") -> Any:
    """`parse` of a run file's text (JSON unless told); missing or corrupt, a CRRError naming the file."""
    try:
        return parse(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CRRError(f"{path} is missing: the run directory is incomplete (deleted or never written)") from None
    except (ValueError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = " ".join(str(e).split())[:160]
        raise CRRError(f"{path} is corrupt (not {what}: {reason})") from None


def read_run_mapping(path: Path, what: str = "JSON") -> dict:
    """A run file that holds one mapping (config.yaml, manifest.json, ledger.json)."""
    data = read_run_file(path, yaml.safe_load if what == "YAML" else json.loads, what)
    if what == "YAML" and data is None:
        return {}
    if not isinstance(data, dict):
        raise CRRError(f"{path} is corrupt (a {type(data).__name__}, not a {what} mapping)")
    return data


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent, check=False)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@dataclass
class RunDir:
    path: Path

    @classmethod
    def create(cls, command: str, name: str = "run", *, root: Path | str = DEFAULT_ROOT,
               config: dict | None = None, seeds: dict | None = None) -> RunDir:
        """Make a fresh run directory and write its config and manifest."""
        if Path(root).exists() and not Path(root).is_dir():
            raise CRRError(f"{root} is a file, not a directory to make run directories in")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        base = Path(root) / f"{stamp}-{command}-{name}"
        path, n = base, 1
        while path.exists():  # two runs in the same second
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir(parents=True)
        except OSError as e:
            if e.errno in OUTPUT_ERRNOS | PATH_ERRNOS:
                raise _refused(path, e) from None
            raise CRRError(f"cannot make the run directory {path}: {e.strerror or e}") from None   # (--out /proc/x)
        try:
            lock_run(path, command)
            atomic_write_text(path / "config.yaml", yaml.safe_dump(config or {}, sort_keys=False))
            atomic_write_json(path / "manifest.json", {
                "crr_version": __version__, "git_commit": _git_commit(), "command": command,
                "argv": sys.argv, "created_utc": stamp, "host": socket.gethostname(),
                "platform": platform.platform(), "python": platform.python_version(),
                "packages": _package_versions(), "seeds": seeds or {},
            })
        except BaseException:
            cls(path).discard()
            raise
        return cls(path)

    def discard(self) -> None:
        """Remove a run directory that could not be made whole (a refused or failed start leaves nothing)."""
        fd = _locks.pop(self.path.resolve(), None)
        if fd is not None:
            os.close(fd)
        shutil.rmtree(self.path, ignore_errors=True)

    @classmethod
    def open(cls, path: Path | str, *, write: bool = False) -> RunDir:
        """An existing run directory; with `write` (resuming it), this process becomes its one writer."""
        path = Path(path)
        if not (path / "manifest.json").is_file():
            raise CRRError(f"{path} is not a crr run directory (no manifest.json); "
                           "pass a directory made by a crr command")
        run = cls(path)
        if write:
            run.lock()
        return run

    def lock(self) -> None:
        """Become this run directory's one writer (see LOCK_FILE); CRRError naming the owner if it has one."""
        lock_run(self.path, self.manifest.get("command", "?"))

    @property
    def config(self) -> dict:
        return read_run_mapping(self.path / "config.yaml", "YAML")

    @property
    def manifest(self) -> dict:
        return read_run_mapping(self.path / "manifest.json")

    def write_json(self, name: str, obj: Any) -> Path:
        atomic_write_json(self.path / name, obj)
        return self.path / name

    def write_text(self, name: str, text: str) -> Path:
        atomic_write_text(self.path / name, text)
        return self.path / name

    def append(self, name: str, record: dict) -> None:
        append_jsonl(self.path / name, record)

    def records(self, name: str) -> list[dict]:
        return list(read_jsonl(self.path / name))

    def rewrite_records(self, name: str, records: list[dict]) -> None:
        """Replace a JSONL log by `records` at once (what was cut from it is gone, nothing else is)."""
        self.write_text(name, "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in records))

    def log_metrics(self, record: dict) -> None:
        self.append("metrics.jsonl", {"time": time.time(), **record})
