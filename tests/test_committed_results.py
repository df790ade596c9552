"""Committed results (results/reference/...) and shipped task sets (crr/tasks/sets/...) must read the same on every clone: no path of the machine that
made them (its checkout, home, cache or temporary directories), only paths relative to the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# an absolute path under a directory that names a machine's layout, not the repository
MACHINE_PATH = re.compile(rb"(?<![\w.~-])/(?:work|home|tmp|root|Users|mnt|scratch|var/folders)/[\w.-]")


def test_no_committed_result_names_a_path_of_the_machine_that_made_it():
    files = subprocess.run(["git", "ls-files", "-z", "results", "crr/tasks/sets"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / p for p in files.decode().split("\0") if p]
    assert paths, "no committed results found"
    found = []
    for path in paths:
        data = path.read_bytes()
        if (m := MACHINE_PATH.search(data)) or (m := re.search(re.escape(str(ROOT).encode()), data)):
            found.append(f"{path.relative_to(ROOT)}: {m.group().decode(errors='replace')}...")
    assert found == [], "absolute paths in committed results (make them relative to the repository):\n" + "\n".join(found)


def test_the_check_sees_the_paths_it_is_for():
    for bad in (b"--run /work/main/results/x", b'"model": "/root/.cache/crr/models/tiny-1"', b"/home/ana/crr/runs",
                b"at /tmp/pytest-of-x/run"):
        assert MACHINE_PATH.search(bad), bad
    for fine in (b"--run results/reference/x", b"~/.cache/crr/models/tiny-1", b"/testbed/pkg/core.py", b"a/work/b"):
        assert not MACHINE_PATH.search(fine), fine
