"""The deterministic package mirror (paper: Appendix "Determinism Filter and Network Replay").

A task's environment is a lock: the whole closure of wheels its test suite needs, each pinned by
version and sha256 in pip's hash-checking format (`name==version --hash=sha256:HEX`). The lock is
resolved once, on the host (`pip download`, the one network door of an environment), and its wheels
kept in a wheelhouse named by the lock's digest. Every sandbox then installs from that wheelhouse
with `pip --no-index --require-hashes`, so what it gets is bit-identical on every machine and every
day, whatever happens upstream; a wheel that does not match its hash is an error, never installed.

Sandboxes see the same layout on both engines (baked into a `crr-env:*` image for Docker; bound
read-only into each local sandbox's mount namespace):

    /opt/crr/requirements.lock   the lock
    /opt/crr/wheelhouse/         its wheels
    /opt/crr/env/                a venv with the lock installed, first on PATH

with PIP_NO_INDEX=1 and PIP_FIND_LINKS=/opt/crr/wheelhouse, so a `pip install` inside a rollout finds
the frozen wheels and nothing else. pip itself and vcrpy (the HTTP replay layer, crr.sandbox.http)
are pinned in every lock like any other package.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from crr.errors import CRRError
from crr.sandbox import http
from crr.sandbox.checkout import building, cache_root
from crr.rundir import atomic_write_text

log = logging.getLogger(__name__)

ENV_ROOT = "/opt/crr"  # where sandboxes see an environment
LOCK_FILE = "requirements.lock"
# Installed in every environment: the installer (so a rollout's `pip` is pinned too) and the HTTP
# record/replay's library.
BASE_REQUIREMENTS = ("pip==25.1.1", "vcrpy==9.4.2")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PIP_TIMEOUT_S = 900
# The host's pip settings that still apply to crr's downloads; every other PIP_* variable (extra
# indexes, find-links, constraints) and every pip config file is dropped, so a lock resolves against
# the index alone and means the same on any machine.
_PIP_KEEP = ("PIP_INDEX_URL", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT")
_MISMATCH = "DO NOT MATCH THE HASHES"


def digest(lines: Sequence[str]) -> str:
    """The lock's identity: sha256 over its lines."""
    return hashlib.sha256("".join(f"{line}\n" for line in lines).encode()).hexdigest()


def lock(requirements: Sequence[str]) -> list[str]:
    """Resolve `requirements` (plus BASE_REQUIREMENTS) into a hash-pinned lock of wheels for this
    Python, and fill its wheelhouse on the way. Resolved once per machine: the same requirements
    give the same lock from the cache, without the network."""
    wanted = sorted({*BASE_REQUIREMENTS, *requirements})
    key = hashlib.sha256(json.dumps([wanted, list(sys.version_info[:2]), _index()]).encode()).hexdigest()[:16]
    cached = cache_root() / "locks" / f"{key}.lock"
    if cached.is_file():
        return cached.read_text().split("\n")[:-1]
    tmp = Path(tempfile.mkdtemp(prefix="crr-lock-"))
    try:
        _pip("download", "--only-binary=:all:", "--dest", str(tmp), *wanted,
             what=f"resolve {' '.join(wanted)} into wheels")
        lines = sorted(_pin(wheel) for wheel in tmp.glob("*.whl"))
        (tmp / LOCK_FILE).write_text("".join(f"{line}\n" for line in lines))
        dest = _wheelhouse_dir(lines)
        if not dest.is_dir():
            with building(dest) as staged:
                shutil.move(str(tmp), staged)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_text(cached, "".join(f"{line}\n" for line in lines))
    log.info("locked %d wheels for %s (lock %s)", len(lines), " ".join(wanted), digest(lines)[:12])
    return lines


def wheelhouse(lines: Sequence[str]) -> Path:
    """The wheelhouse of a lock: its wheels and LOCK_FILE, downloaded (hash-checked) on first use."""
    dest = _wheelhouse_dir(lines)
    if (dest / LOCK_FILE).is_file():
        return dest
    with building(dest) as w:
        w.mkdir()
        (w / LOCK_FILE).write_text("".join(f"{line}\n" for line in lines))
        _pip("download", "--no-deps", "--only-binary=:all:", "--require-hashes", "-r", str(w / LOCK_FILE),
             "--dest", str(w), what=f"download the wheels of lock {digest(lines)[:12]}")
        got = sorted(_pin(wheel) for wheel in w.glob("*.whl"))
        if got != sorted(lines):  # pip checked every hash; this catches a lock that misses a wheel
            raise CRRError(f"the wheels downloaded for lock {digest(lines)[:12]} are not the lock's "
                           f"({len(got)} vs {len(lines)} wheels); regenerate the lock")
    return dest


def local_environment(lines: Sequence[str]) -> Path:
    """The ENV_ROOT tree of a lock for the local engine: built once per machine from the wheelhouse,
    with no index, by the same script a Docker env image runs (`install_script`)."""
    python = getattr(sys, "_base_executable", sys.executable)
    key = hashlib.sha256(f"{environment_key(lines)}\0{python}".encode()).hexdigest()[:16]
    root = cache_root() / "environments" / key
    if (root / ".complete").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    # Built in place under a lock, not renamed into place: a venv's scripts name its path.
    with open(root.parent / f"{key}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (root / ".complete").is_file():
            return root
        shutil.rmtree(root, ignore_errors=True)  # a build cut short
        stage(lines, root)
        env = {"PATH": SYSTEM_PATH, "HOME": str(root), "LANG": "C.UTF-8"}
        out = subprocess.run(["bash", "-c", install_script(str(root), python)], capture_output=True, text=True,
                             env=env, timeout=PIP_TIMEOUT_S, check=False)
        if out.returncode != 0:
            raise CRRError(f"building the environment of lock {digest(lines)[:12]} failed:\n"
                           f"{_explain(out.stdout + out.stderr)}")
        (root / ".complete").write_text(digest(lines) + "\n")
    log.info("built the local environment %s for lock %s", root, digest(lines)[:12])
    return root


def project_metadata(tree: Path, build_requires: Sequence[str], docker_engine=None) -> dict:
    """The core metadata (as pip's installation report gives it: name, version, requires_dist, ...) of the
    source tree `tree` (left untouched), built by its PEP 517 backend: pip prepares it in an isolated build
    environment installed from the hash-pinned wheelhouse of `build_requires`, with no index.

    The backend is the package's own code (an in-tree backend, a setup.py), which nobody here wrote, so it
    never runs on the host (issue 31): pip runs in a sandbox with no network that sees a copy of the tree
    and the wheelhouse, read-only, and nothing else of this machine. With `docker_engine` (a DockerEngine: its
    client and base image), a `docker run --network none` of its base image; else bubblewrap (`metadata_sandbox`)."""
    house = wheelhouse(lock([*build_requires, "wheel"]))
    pip = next(house.glob("pip-*.whl"), None)  # a container's pip: the lock's own wheel (BASE_REQUIREMENTS)
    if pip is None:
        raise CRRError(f"the wheelhouse {house} holds no pip wheel; delete it under the crr cache and retry")
    with tempfile.TemporaryDirectory(prefix="crr-metadata-") as tmp:
        # backends write into the tree they build (egg-info, build/): into the copy, not into `tree`
        shutil.copytree(tree, Path(tmp) / "src", ignore=shutil.ignore_patterns(".git"))
        (Path(tmp) / "out").mkdir()
        argv = ["install", "--quiet", "--dry-run", "--ignore-installed",
                "--no-deps", "--no-index", "--find-links", _WHEELHOUSE_AT, "--report", f"{_WORK_AT}/out/report.json",
                f"{_WORK_AT}/src"]
        env = {"PATH": SYSTEM_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        what = f"build the metadata of {tree.name} (in a sandbox with no network)"
        if docker_engine is not None:
            code, output = _in_container(docker_engine, ["python3", f"{_WHEELHOUSE_AT}/{pip.name}/pip", *argv], env,
                                         Path(tmp), house)
        else:  # this interpreter's own pip, as on the host before (its byte code is cached: ~2x faster than a wheel's)
            code, output = _in_bwrap([sys.executable, "-m", "pip", *argv], env, Path(tmp), house)
        if code != 0:
            raise CRRError(f"pip could not {what}:\n{_explain(output)}")
        return json.loads((Path(tmp) / "out" / "report.json").read_text())["install"][0]["metadata"]


_WORK_AT, _WHEELHOUSE_AT = "/crr-build", "/wheelhouse"  # where a metadata sandbox sees its tree copy and wheels


def _in_container(engine, argv: list[str], env: dict, work: Path, house: Path) -> tuple[int, str]:
    """`argv` in a throwaway container of the Docker engine's base image: no network, `work` and the
    wheelhouse (read-only) bound."""
    import docker  # deferred: only synth on the Docker engine needs it here
    import requests

    box = engine.client.containers.run(engine.base_image, argv, detach=True, network_mode="none", environment=env,
                                working_dir=_WORK_AT, labels={"org.crr.role": "metadata"},
                                volumes={str(work): {"bind": _WORK_AT, "mode": "rw"},
                                         str(house): {"bind": _WHEELHOUSE_AT, "mode": "ro"}})
    try:
        try:
            code = box.wait(timeout=PIP_TIMEOUT_S)["StatusCode"]
        except requests.RequestException:  # ReadTimeout / ConnectionError: the wait ran out
            return 124, f"timed out after {PIP_TIMEOUT_S} s"
        return code, box.logs().decode("utf-8", errors="replace")
    except docker.errors.DockerException as e:
        raise CRRError(f"the metadata container failed: {e}") from None
    finally:
        box.remove(force=True)


def _in_bwrap(argv: list[str], env: dict, work: Path, house: Path) -> tuple[int, str]:
    """`argv` in a bubblewrap sandbox (`metadata_sandbox`)."""
    try:
        out = subprocess.run([*metadata_sandbox(work, house, env), *argv],
                             capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {PIP_TIMEOUT_S} s"
    return out.returncode, out.stdout + out.stderr


def metadata_sandbox(work: Path, house: Path, env: dict[str, str]) -> list[str]:
    """bwrap's command line for a metadata build without a Docker engine: every namespace new (no network,
    no host process), every capability dropped, a root that holds only the system's /usr and this
    interpreter's install and virtual environment read-only, a fresh /proc, /dev and /tmp, `work` at
    /crr-build and the wheelhouse read-only at /wheelhouse; `env` the whole environment. No other file of
    the host (its /etc, /root, /home, the runs) is there to read or write. bubblewrap, the sandbox Flatpak
    is built on, because it does this in one well-kept tool."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise CRRError("an sdist without Requires-Dist has its metadata built in a sandbox, and neither bubblewrap "
                       "(apt-get install bubblewrap) nor --engine docker is there to give one")
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):  # usrmerge links, or the directories themselves
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # before the binds: a venv may be under /tmp
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix)):
        real = os.path.realpath(prefix)
        if real != "/usr" and not real.startswith("/usr/"):
            args += [arg for at in dict.fromkeys((real, prefix)) for arg in ("--ro-bind", real, at)]
    args += ["--bind", str(work), _WORK_AT, "--ro-bind", str(house), _WHEELHOUSE_AT, "--chdir", _WORK_AT]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--"]


def stage(lines: Sequence[str], root: Path) -> None:
    """Fill `root` with what `install_script` needs: the lock, its wheelhouse and the HTTP plugin."""
    source = wheelhouse(lines)
    (root / "wheelhouse").mkdir(parents=True)
    for wheel in source.glob("*.whl"):
        try:
            os.link(wheel, root / "wheelhouse" / wheel.name)
        except OSError:
            shutil.copy2(wheel, root / "wheelhouse" / wheel.name)
    shutil.copy2(source / LOCK_FILE, root / LOCK_FILE)
    shutil.copy2(http.PLUGIN_SOURCE, root / f"{http.PLUGIN_MODULE}.py")


def install_script(root: str, python: str) -> str:
    """Make the venv ROOT/env and install the lock into it from ROOT/wheelhouse only (pip runs
    from its own pinned wheel), then add the HTTP plugin; the same on both engines."""
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return "\n".join([
        "set -euo pipefail",
        "export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1",
        f"cd {root}",
        f"{python} -m venv --without-pip env",
        "pips=(wheelhouse/pip-*.whl)",
        'env/bin/python "${pips[0]}/pip" install --quiet --no-index --find-links wheelhouse --require-hashes '
        f"--no-warn-script-location -r {LOCK_FILE}",
        f'cp {http.PLUGIN_MODULE}.py "$(env/bin/python -c "{purelib}")"/', ""])


def environment_key(lines: Sequence[str]) -> str:
    """What an environment is built from: the lock, the HTTP plugin and the install script."""
    parts = [digest(lines), http.PLUGIN_SOURCE.read_text(), install_script("ROOT", "PYTHON")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def sandbox_env(root: str, repo_dir: str, record: bool) -> dict[str, str]:
    """The variables every command of a task with an environment runs with (both engines)."""
    return {"PATH": f"{root}/env/bin:{SYSTEM_PATH}", "VIRTUAL_ENV": f"{root}/env",
            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": f"{root}/wheelhouse", "PIP_CONFIG_FILE": "/dev/null",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", **http.sandbox_env(repo_dir, record)}


def _wheelhouse_dir(lines: Sequence[str]) -> Path:
    return cache_root() / "wheelhouses" / digest(lines)[:16]


def _pin(wheel: Path) -> str:
    try:
        name, version, _, _ = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as e:
        raise CRRError(f"pip downloaded {wheel.name}, which is not a wheel ({e})") from None
    return f"{name}=={version} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"


def _index() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")


def _pip(*args: str, what: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in _PIP_KEEP}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    try:
        out = subprocess.run([sys.executable, "-m", "pip", *args, "--quiet"], capture_output=True, text=True,
                             env=env, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise CRRError(f"pip could not {what} in {PIP_TIMEOUT_S} s; is {_index()} reachable?") from None
    if out.returncode != 0:
        raise CRRError(f"pip could not {what}:\n{_explain(out.stderr + out.stdout)}")


def _explain(output: str) -> str:
    """pip's error, and what to do about the one that matters most here."""
    tail = "\n".join(output.strip().splitlines()[-12:])
    if _MISMATCH in output:
        return (f"{tail}\nA wheel does not match the sha256 its lock pins: upstream replaced the file, or the "
                "lock or the wheelhouse was edited. Nothing was installed; regenerate the task's lock "
                "(`crr tasks synth`) or delete the damaged wheelhouse under the crr cache.")
    if "No matching distribution" in output:
        return f"{tail}\nEvery requirement must be available as a wheel for this Python (no builds)."
    return tail
