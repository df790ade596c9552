"""`crr doctor`: is this machine ready for crr? Each check says what is missing and the fix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

BASE_IMAGE = os.environ.get("CRR_BASE_IMAGE", "crr-base:bookworm")
MIN_FREE_GB = 5.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # False: only some features need it (e.g. Docker for --engine docker)


def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", ok, sys.version.split()[0], "install Python >= 3.11")


def _package(name: str, want: str, fix: str) -> Check:
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return Check(name, False, "not installed", fix)
    return Check(name, version.startswith(want), version, fix)


def _torch() -> Check:
    check = _package("torch", "2.13.0", "pip install torch==2.13.0  (the CPU build)")
    if check.ok:
        return Check("torch", True, f"{check.detail} ({'cuda' if _cuda() else 'cpu only'})")
    return check


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The CPU flags that mean native bf16 arithmetic: x86's AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The first processor's feature flags (x86 `flags`, Arm `Features`); None where the file is absent."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _bf16(cuda: bool, flags: set[str] | None) -> Check:
    """The shipped default's weights are bf16; a CPU without native bf16 emulates it, and a learner update of
    `make main` takes 50-70 s there against 5-6 s (docs/setup.md, docs/warm-start.md)."""
    fix = "train and evaluate in fp32 here: crr train ... dtype=float32, crr eval ... --dtype float32"
    if cuda:
        return Check("bf16 arithmetic", True, "on the GPU", required=False)
    if flags is None:
        return Check("bf16 arithmetic", True, "not checked (no /proc/cpuinfo)", required=False)
    native = sorted(flags.intersection(NATIVE_BF16))
    if native:
        return Check("bf16 arithmetic", True, f"native ({', '.join(native)})", required=False)
    return Check("bf16 arithmetic", False, "emulated by this CPU: bf16 training about 10x slower", fix,
                 required=False)


def _docker_daemon() -> Check:
    fix = "apt-get install docker.io && dockerd &   (or: sudo systemctl start docker)"
    if not shutil.which("docker"):
        return Check("docker daemon", False, "docker CLI not found", fix, required=False)
    try:
        import docker

        version = docker.from_env(timeout=5).version()["Version"]
        return Check("docker daemon", True, f"server {version}", required=False)
    except Exception as e:  # docker-py raises several unrelated types when the socket is absent
        return Check("docker daemon", False, f"unreachable ({type(e).__name__})", fix, required=False)


def _base_image(daemon_ok: bool) -> Check:
    fix = "scripts/build-base-image.sh   (debootstrap + docker import, no registry)"
    if not daemon_ok:
        return Check("base image", False, f"{BASE_IMAGE}: daemon unreachable", fix, required=False)
    import docker

    try:
        docker.from_env(timeout=5).images.get(BASE_IMAGE)
        return Check("base image", True, BASE_IMAGE, required=False)
    except docker.errors.ImageNotFound:
        return Check("base image", False, f"{BASE_IMAGE} missing", fix, required=False)


def _overlayfs() -> Check:
    """Try a real overlay mount: the local fork engine's fast path needs one."""
    fix = "run as root on a kernel with overlayfs (the local engine falls back to plain copies)"
    with tempfile.TemporaryDirectory(prefix="crr-doctor-") as tmp:
        dirs = {n: Path(tmp, n) for n in ("lower", "upper", "work", "merged")}
        for d in dirs.values():
            d.mkdir()
        opts = f"lowerdir={dirs['lower']},upperdir={dirs['upper']},workdir={dirs['work']}"
        res = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(dirs["merged"])],
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            return Check("overlayfs", False, res.stderr.strip()[:80] or "mount failed", fix, required=False)
        subprocess.run(["umount", str(dirs["merged"])], capture_output=True, check=False)
    return Check("overlayfs", True, "mount works", required=False)


def _netns() -> Check:
    res = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True, check=False)
    ok = res.returncode == 0
    return Check("network namespace", ok, "unshare --net works" if ok else res.stderr.strip()[:80],
                 "run as root (sandboxed commands then have no network)", required=False)


def _disk() -> Check:
    from crr.sandbox.checkout import cache_root

    try:
        root = cache_root()
    except OSError as e:
        return Check("free disk", False, f"no cache directory ({e.filename}: {e.strerror})",
                     "set CRR_CACHE_DIR to a directory crr can create and write")
    free_gb = shutil.disk_usage(root).free / 1e9
    return Check("free disk", free_gb >= MIN_FREE_GB, f"{free_gb:.1f} GB free at {root}",
                 f"free at least {MIN_FREE_GB:.0f} GB or set CRR_CACHE_DIR to a larger disk")


def run_checks() -> list[Check]:
    checks = [_python(), _torch(), _bf16(_cuda(), cpu_flags()),
              _package("trl", "1.16", "pip install 'trl>=1.16,<1.17'"),
              _package("swebench", "5.", "pip install 'swebench>=5.0.2,<6'")]
    daemon = _docker_daemon()
    checks += [daemon, _base_image(daemon.ok), _overlayfs(), _netns(), _disk()]
    return checks
