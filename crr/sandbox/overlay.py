"""Copy-on-write workspaces over a read-only base tree: the file-system half of a fork.

An `OverlayWorkspace` mounts overlayfs with the task's base checkout (and at most one snapshot
`Layer`) below and a private upper dir on top; every write lands in the upper dir. A snapshot
copies that upper dir (the diff: a few files) into a new `Layer`; restoring mounts a fresh upper
over "<layer>:<base>". A snapshot of a restored workspace flattens: its layer is the parent layer
merged with the current upper dir, so a stack never holds more than two lowers however deep forks
of forks go (overlayfs caps `lowerdir=` at one page).

`CopyWorkspace` is the fallback where overlayfs cannot be mounted (not root, an upper dir on a
file system overlayfs rejects): the same interface with full copies of the tree.

Neither knows about processes; the local engine runs commands in `tree`, and the Docker engine's
overlay mode bind-mounts `tree` into a pooled container.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Self

from crr.errors import CRRError, SandboxError

log = logging.getLogger(__name__)

_OPAQUE = "trusted.overlay.opaque"  # on an upper dir: hide the same dir in the layers below
# redirect_dir/metacopy would let an upper entry point into a lower layer, which a flattened copy
# cannot follow; with them off, every upper entry is self-contained (renaming a lower dir gives
# EXDEV and `mv` falls back to copy + delete).
_MOUNT_OPTS = "redirect_dir=off,metacopy=off,index=off,xino=off"
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


class Layer:
    """A frozen tree (one snapshot) that restored workspaces stack on.

    Reference counted: the snapshot's owner holds one reference and each workspace mounted on it
    another; the directory is deleted when the last one is released.
    """

    def __init__(self, path: Path, base: Path):
        self.path, self.base = path, base  # base: the tree this layer sits on (overlay mode)
        self._refs, self._lock = 1, threading.Lock()

    def acquire(self) -> Layer:
        with self._lock:
            if self._refs == 0:
                raise SandboxError(f"snapshot layer {self.path} was already released")
            self._refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            if self._refs == 0:
                return
            self._refs -= 1
            gone = self._refs == 0
        if gone:
            shutil.rmtree(self.path, ignore_errors=True)


class OverlayWorkspace:
    """`tree` is an overlay mount: `layer` (if any) over `base`, writes going to a private upper dir.

    `root` must not exist yet; it receives upper/, work/ and tree/ and is removed by `close()`.
    """

    def __init__(self, root: Path, base: Path, layer: Layer | None = None):
        lowers = [layer.path, base] if layer else [base]
        for p in [*lowers, root]:
            if any(c in str(p) for c in ",:\\"):
                raise CRRError(f"overlayfs cannot take the path {p} (it holds ',', ':' or '\\'); "
                               "use a sandbox workdir and CRR_CACHE_DIR without those characters")
        root.mkdir(parents=True)  # before the try: a root that already exists is not ours to delete
        self.root, self.base = root, base
        self.upper, self.tree = root / "upper", root / "tree"
        self.layer, self._mounted = None, False
        try:
            self.layer = layer.acquire() if layer else None
            for d in (self.upper, root / "work", self.tree):
                d.mkdir()
            _copy_meta(str(lowers[0]), str(self.upper), os.lstat(lowers[0]))  # the tree root's mode
            opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={self.upper},workdir={root / 'work'}"
            _mount(self.tree, f"{opts},{_MOUNT_OPTS}")
            self._mounted = True
        except BaseException:
            self.close()
            raise

    @classmethod
    def restore(cls, layer: Layer, root: Path) -> OverlayWorkspace:
        """A fresh, independent workspace showing exactly the tree `layer` was taken from."""
        return cls(root, layer.base, layer)

    def snapshot(self, dest: Path) -> Layer:
        """Freeze the current tree into a new layer at `dest` (which must not exist).

        Commands must not be writing to the tree meanwhile (the upper dir is read directly).
        """
        try:
            if self.layer is None:
                _copy(str(self.upper), str(dest), {})
            else:  # flatten: parent layer + our upper dir become one layer over the same base
                _copy(str(self.layer.path), str(dest), {})
                _merge(str(self.upper), str(dest), {})
                _copy_meta(str(self.upper), str(dest), os.lstat(self.upper))
        except OSError as e:
            shutil.rmtree(dest, ignore_errors=True)
            raise SandboxError(f"snapshot of {self.tree} into {dest} failed: {e}") from e
        return Layer(dest, self.base)

    def close(self) -> None:
        """Unmount and delete everything under `root`; idempotent."""
        if self._mounted:
            unmount(str(self.tree))
            self._mounted = False
        shutil.rmtree(self.root, ignore_errors=True)
        if self.layer is not None:
            self.layer.release()
            self.layer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CopyWorkspace:
    """The plain-copy fallback: `tree` is a full copy of the base (or of a layer)."""

    def __init__(self, root: Path, base: Path, layer: Layer | None = None):
        root.mkdir(parents=True)
        self.root, self.base, self.tree = root, base, root / "tree"
        try:
            _copy(str(layer.path if layer else base), str(self.tree), {})
        except BaseException:
            self.close()
            raise

    @classmethod
    def restore(cls, layer: Layer, root: Path) -> CopyWorkspace:
        return cls(root, layer.base, layer)

    def snapshot(self, dest: Path) -> Layer:
        try:
            _copy(str(self.tree), str(dest), {})
        except OSError as e:
            shutil.rmtree(dest, ignore_errors=True)
            raise SandboxError(f"snapshot of {self.tree} into {dest} failed: {e}") from e
        return Layer(dest, self.base)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Workspace = OverlayWorkspace | CopyWorkspace


def overlay_unavailable(scratch: Path) -> str | None:
    """Why an overlay workspace cannot be made under `scratch` (None when it can): mounts a tiny one."""
    scratch.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(dir=scratch, prefix=".overlay-probe-"))
    try:
        (probe / "base").mkdir()
        OverlayWorkspace(probe / "ws", probe / "base").close()
        return None
    except (OSError, CRRError) as e:
        return str(e)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def unmount(path: str) -> None:
    """Unmount `path`; lazily if something still holds it. Not mounted is not an error."""
    if _libc.umount2(path.encode(), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(path.encode(), _MNT_DETACH) == 0:
        # nothing for a person to act on: the kernel finishes the unmount when the last holder lets go
        log.info("%s was busy; detached it lazily", path)
        return
    if err not in (errno.EINVAL, errno.ENOENT):
        log.warning("could not unmount %s: %s", path, os.strerror(err))


def mount_tmpfs(target: Path, size_mb: int) -> None:
    """A tmpfs of at most `size_mb` at `target`: a sandbox's writable state, capped as a whole (writing
    more fails with ENOSPC). OSError where it cannot be mounted (not root)."""
    if _libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, f"size={size_mb}m,mode=0755".encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"tmpfs at {target}: {os.strerror(err)}")


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path`, deepest first: the order to unmount them in."""
    prefix = str(Path(path).resolve())
    with open("/proc/self/mountinfo") as f:  # mount points escape spaces and the like as \ooo
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in f]
    return sorted({p for p in points if p == prefix or p.startswith(prefix + "/")}, reverse=True)


def process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (None if there is no such process): pid + start time name a
    process uniquely, where a pid alone may have been reused. Used to tell live owners of leftovers."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _mount(target: Path, options: str) -> None:
    # mount(2) directly: spawning mount(8) would cost ~5 ms of a ~7 ms fork.
    if len(options) >= os.sysconf("SC_PAGE_SIZE"):
        raise SandboxError(f"overlay options for {target} exceed one page ({len(options)} bytes); "
                           "use a shorter sandbox workdir")
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", 0, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"overlay mount at {target} failed: {os.strerror(err)} "
                           f"(needs root and an upper dir on ext4/xfs/tmpfs)")


# Hand-written rather than `cp -a`: flattening has to interpret whiteouts and opaque dirs entry by
# entry, and one in-process walker (no spawn) serves plain copies and merges alike.

def _copy(src: str, dst: str, links: dict) -> None:
    """Copy `src` to the new path `dst` recursively: contents, modes, owners, times, xattrs, hard
    links (via `links`), symlinks, whiteouts (char devices 0/0) and other special files."""
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst)
        with os.scandir(src) as it:
            for entry in it:
                _copy(entry.path, os.path.join(dst, entry.name), links)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in links:
            os.link(links[key], dst)
            return
        shutil.copyfile(src, dst)  # copy_file_range/sendfile under the hood
        if st.st_nlink > 1:
            links[key] = dst
    else:
        os.mknod(dst, st.st_mode, st.st_rdev)
    _copy_meta(src, dst, st)


def _merge(upper: str, dst: str, links: dict) -> None:
    """Apply the upper dir `upper` onto the layer copy `dst` so that `dst` alone shows what the
    two showed stacked (over the same base)."""
    with os.scandir(upper) as it:
        for entry in it:
            src, out = entry.path, os.path.join(dst, entry.name)
            st = os.lstat(src)
            try:
                old = os.lstat(out)
            except FileNotFoundError:
                old = None
            is_dir = stat.S_ISDIR(st.st_mode)
            if is_dir and old is not None and stat.S_ISDIR(old.st_mode) and not _opaque(src):
                _merge(src, out, links)  # the dir is in both: the union of their children
                _copy_meta(src, out, st)
                continue
            if old is not None:
                if stat.S_ISDIR(old.st_mode):
                    shutil.rmtree(out)
                else:
                    os.unlink(out)
            _copy(src, out, links)  # whiteouts and opaque dirs carry over as they are
            if is_dir and old is not None and not stat.S_ISDIR(old.st_mode):
                # The layer hid the base's entry here (whiteout or file): the new dir must too.
                os.setxattr(out, _OPAQUE, b"y", follow_symlinks=False)


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))  # after chown, which clears set-id bits
        for name in os.listxattr(src, follow_symlinks=False):
            # overlayfs bookkeeping (origin, impure) refers to the upper dir it came from; only
            # opacity means something in a layer.
            if name.startswith("trusted.overlay.") and name != _OPAQUE:
                continue
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
