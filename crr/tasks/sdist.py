"""Source distributions from PyPI: the real repositories behind `crr tasks synth` tasks.

An sdist is found through the index's JSON Simple API (PEP 691, what pip itself reads), downloaded
into the crr cache and checked against the sha256 the index publishes (and a task row pins). Its tree
becomes a git repository with one commit made with a fixed identity and date, so one sdist gives
one commit on every machine: a task row needs only the sdist's name, version and hash to rebuild
its repository.
"""

from __future__ import annotations

import configparser
import contextlib
import email
import hashlib
import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
import tomllib
import urllib.error
import urllib.request
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import (InvalidSdistFilename, InvalidWheelFilename, canonicalize_name, parse_sdist_filename,
                             parse_wheel_filename)
from packaging.version import InvalidVersion, Version

from crr.errors import CRRError
from crr.sandbox import mirror
from crr.sandbox.checkout import cache_root
from crr.tasks.micro import pinned_git

log = logging.getLogger(__name__)

TEST_EXTRAS = ("test", "tests", "testing")  # the optional-dependency groups packages put test deps in
_TIMEOUT_S = 120


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    filename: str
    sha256: str
    url: str | None = None

    def row(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_row(cls, row: dict) -> Sdist:
        return cls(**{k: row.get(k) for k in ("name", "version", "filename", "sha256", "url")})


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def find(name: str, version: str) -> Sdist:
    """The sdist of NAME==VERSION on the index; CRRError when there is no such project, release or sdist."""
    project = canonicalize_name(name)
    request = urllib.request.Request(f"{index_url()}/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            files = json.load(response)["files"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise CRRError(f"{name!r} is not a project on {index_url()}; check the name") from None
        raise CRRError(f"the index {index_url()} answered {e.code} for {name!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise CRRError(f"cannot reach the package index {index_url()} ({e}); set PIP_INDEX_URL to a "
                       "reachable mirror") from None
    try:
        wanted = Version(version)
    except InvalidVersion:
        raise CRRError(f"{version!r} is not a valid version; give --package NAME==VERSION") from None
    sdists, released = [], set()
    for f in files:
        try:
            if f["filename"].endswith(".whl"):
                released.add(parse_wheel_filename(f["filename"])[1])
                continue
            file_version = parse_sdist_filename(f["filename"])[1]
        except (InvalidSdistFilename, InvalidWheelFilename, InvalidVersion):
            continue  # eggs, exes and other ancient formats
        released.add(file_version)
        if file_version == wanted and "sha256" in f.get("hashes", {}):
            sdists.append(f)
    if wanted not in released:
        recent = ", ".join(str(v) for v in sorted(released)[-8:])
        raise CRRError(f"{name} has no release {version} on {index_url()}; recent releases: {recent}")
    if not sdists:
        raise CRRError(f"{name} {version} publishes no source distribution (only wheels, which do not carry "
                       "tests); pick a release with a .tar.gz")
    best = min(sdists, key=lambda f: not f["filename"].endswith(".tar.gz"))
    return Sdist(name=project, version=version, filename=best["filename"], sha256=best["hashes"]["sha256"],
                 url=best["url"])


def fetch(sdist: Sdist) -> Path:
    """The sdist archive in the crr cache, downloaded once and sha256-checked every time."""
    path = cache_root() / "sdists" / sdist.sha256[:16] / sdist.filename
    if not path.is_file():
        url = sdist.url or find(sdist.name, sdist.version).url
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".download.")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
                shutil.copyfileobj(response, out)
            os.replace(tmp, path)
        except (urllib.error.URLError, OSError) as e:
            raise CRRError(f"cannot download {url} ({e})") from None
        finally:
            Path(tmp).unlink(missing_ok=True)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != sdist.sha256:
        path.unlink()
        raise CRRError(f"{sdist.filename} has sha256 {actual}, not the {sdist.sha256} its task row or index "
                       "pins: the file changed upstream or in transit; nothing was unpacked")
    return path


def unpack(archive: Path, dest: Path) -> None:
    """The sdist's tree (without its top-level directory) into `dest`, which must not exist."""
    tmp = Path(tempfile.mkdtemp(prefix="crr-sdist-"))
    try:
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                z.extractall(tmp)
        else:
            with tarfile.open(archive) as t:
                t.extractall(tmp, filter="data")  # no absolute paths, links out, or device files
        tops = list(tmp.iterdir())
        root = tops[0] if len(tops) == 1 and tops[0].is_dir() else tmp
        shutil.move(str(root), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pristine_repo(sdist: Sdist, dest: Path) -> str:
    """A git repository of the sdist's tree at `dest`, in one commit (the same on every machine). Where the
    build installs its packages from other directories (a src/ layout), each gets the sdist's metadata as
    `NAME.egg-info/PKG-INFO`, as an editable install (`setup.py develop`) leaves it: with those directories
    on the path, the tests import the repository's code and `importlib.metadata` finds its version."""
    unpack(fetch(sdist), dest)
    pinned_git(dest, "init", "-q", "-b", "main")
    pinned_git(dest, "add", "-A")
    info = dest / "PKG-INFO"
    if info.is_file() and (name := email.message_from_bytes(info.read_bytes()).get("Name")):
        for root in import_roots(dest):
            egg_info = dest / root / f"{canonicalize_name(name).replace('-', '_')}.egg-info"
            if not egg_info.exists():
                egg_info.mkdir()
                shutil.copy2(info, egg_info / "PKG-INFO")
                pinned_git(dest, "add", "-f", str(egg_info.relative_to(dest)))  # .gitignore lists *.egg-info
    pinned_git(dest, "commit", "-q", "-m", f"{sdist.name} {sdist.version} from {sdist.filename}")
    return pinned_git(dest, "rev-parse", "HEAD").strip()


def declared_requirements(tree: Path, docker_engine=None) -> list[str]:
    """What the package's code and its tests need: the Requires-Dist entries that apply here, with or
    without a test extra (markers evaluated for this Python), from the sdist's PKG-INFO, or, where that
    has none (sdists older than Requires-Dist in PKG-INFO), from the metadata its build backend makes in a
    sandbox with no network (mirror.project_metadata: a container of `docker_engine`'s base image, else bubblewrap)."""
    info = tree / "PKG-INFO"
    lines = email.message_from_bytes(info.read_bytes()).get_all("Requires-Dist") if info.is_file() else None
    if not lines:
        lines = mirror.project_metadata(tree, _build_requires(tree), docker_engine).get("requires_dist") or []
    found: list[str] = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            log.warning("%s: ignoring unparsable Requires-Dist %r", tree.name, line)
            continue
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *TEST_EXTRAS)):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            found.append(f"{req.name}{extras}{req.specifier}")
    return found


def _build_requires(tree: Path) -> list[str]:
    """The build system's requirements (pyproject.toml), or PEP 518's default for a setup.py project."""
    pyproject = _pyproject(tree)
    return list(pyproject.get("build-system", {}).get("requires", ["setuptools>=40.8.0"]))


def _pyproject(tree: Path) -> dict:
    try:
        return tomllib.loads((tree / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def import_roots(tree: Path) -> list[str]:
    """The directories (relative to the tree, other than the tree itself) its build installs import packages
    from: what an installation would put on sys.path. The package's tests then import the repository's own
    code (edits included) with these on the path, without installing it. Read from the build's declaration
    (setuptools package-dir and packages.find, hatch wheel packages, poetry packages, pdm package-dir,
    setup.cfg or setup.py package_dir), else a src/ layout's src."""
    tool = _pyproject(tree).get("tool", {})
    setuptools = tool.get("setuptools", {})
    find = setuptools["packages"].get("find", {}) if isinstance(setuptools.get("packages"), dict) else {}
    roots = [setuptools.get("package-dir", {}).get(""), *find.get("where", []),
             *(str(Path(p).parent) for p in tool.get("hatch", {}).get("build", {}).get("targets", {})
               .get("wheel", {}).get("packages", [])),
             *(p.get("from") for p in tool.get("poetry", {}).get("packages", []) if isinstance(p, dict)),
             tool.get("pdm", {}).get("build", {}).get("package-dir")]
    setup_cfg = configparser.ConfigParser()
    with contextlib.suppress(OSError, configparser.Error):
        setup_cfg.read(tree / "setup.cfg")
        roots += [m.group(1) for m in re.finditer(r"^\s*=\s*(\S+)\s*$",
                                                  setup_cfg.get("options", "package_dir", fallback=""), re.M)]
    with contextlib.suppress(OSError):
        setup_py = (tree / "setup.py").read_text(errors="replace")
        roots += re.findall(r"package_dir\s*=\s*\{\s*['\"]{2}\s*:\s*['\"]([^'\"]+)['\"]", setup_py)
    roots = sorted({str(Path(r)) for r in roots if r} - {"."})
    if not roots and (tree / "src").is_dir() and _has_python_code(tree / "src") and not _top_level_package(tree):
        roots = ["src"]
    return [r for r in roots if (tree / r).is_dir()]


def _has_python_code(folder: Path) -> bool:
    return any((p / "__init__.py").is_file() for p in folder.iterdir() if p.is_dir()) or any(folder.glob("*.py"))


def _top_level_package(tree: Path) -> bool:
    """Whether the tree's root holds an import package of its own (tests and docs do not count)."""
    return any((p / "__init__.py").is_file() for p in tree.iterdir()
               if p.is_dir() and p.name not in ("tests", "test", "testing", "docs", "doc"))
