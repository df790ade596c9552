import json
import subprocess
import sys

import pytest

from crr.errors import CRRError
from crr.rundir import LOCK_FILE, RunDir, append_jsonl, read_jsonl, release_locks


def test_run_directory_has_config_and_manifest(tmp_path):
    run = RunDir.create("train", "x", root=tmp_path, config={"lr": 5e-6}, seeds={"python": 11})
    again = RunDir.open(run.path)
    assert again.config == {"lr": 5e-6}
    assert again.manifest["seeds"] == {"python": 11} and again.manifest["packages"]["torch"]
    assert RunDir.create("train", "x", root=tmp_path).path != run.path  # same second, new dir


def test_opening_something_else_is_a_clear_error(tmp_path):
    with pytest.raises(CRRError, match="not a crr run directory"):
        RunDir.open(tmp_path)


def test_a_torn_last_record_is_skipped_and_cut_before_the_next_append(tmp_path):
    log = tmp_path / "results.jsonl"
    append_jsonl(log, {"a": 1})
    with open(log, "a") as f:
        f.write('{"b": 2, "trunc')  # the writer died mid-record
    assert list(read_jsonl(log)) == [{"a": 1}]
    append_jsonl(log, {"c": 3})
    assert list(read_jsonl(log)) == [{"a": 1}, {"c": 3}]
    assert log.read_text().endswith('{"c": 3}\n')


def test_corruption_before_the_last_line_is_an_error(tmp_path):
    log = tmp_path / "m.jsonl"
    log.write_text('{"a": 1}\nnot json\n' + json.dumps({"b": 2}) + "\n")
    with pytest.raises(CRRError, match="m.jsonl:2"):
        list(read_jsonl(log))
    log.write_text('{"a": 1}\n[1, 2]\n')   # whole JSON, but not a record: no torn append looks like that
    with pytest.raises(CRRError, match="m.jsonl:2: a list, not a JSON object"):
        list(read_jsonl(log))
    log.write_bytes(b'{"a": 1}\n\xff\xfe garbage\n')
    with pytest.raises(CRRError, match="m.jsonl:2: corrupt JSON record"):
        list(read_jsonl(log))


def test_a_run_directory_has_one_writer_and_the_kernel_frees_it_with_its_owner(tmp_path):
    run = RunDir.create("eval", "locked", root=tmp_path)
    release_locks()
    # a writer in another process: this one may read the run but not write it, until the owner dies
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time; from crr.rundir import RunDir; "
                              "RunDir.open(sys.argv[1], write=True); print('locked', flush=True); time.sleep(60)",
                              str(run.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline() == "locked\n"
        with pytest.raises(CRRError, match=rf"is in use by crr process {owner.pid} \(`crr eval` on "):
            RunDir.open(run.path, write=True)
        assert RunDir.open(run.path).manifest["command"] == "eval"  # readers take no lock
    finally:
        owner.kill()
        owner.wait()
    RunDir.open(run.path, write=True)  # SIGKILL: no stale lock
    RunDir.open(run.path, write=True)  # the writer may open its run again
    release_locks()
    assert (run.path / LOCK_FILE).read_text() == ""  # released: no pid of a past writer left in it


def test_an_append_the_disk_refuses_part_way_leaves_whole_records(tmp_path):
    """A record the file system takes only part of (a full disk; here a file size limit, which fails a write the
    same way after a short one) is cut back: the log ends on its last whole record."""
    path = tmp_path / "log.jsonl"
    script = f"""
import resource
from pathlib import Path
from crr.rundir import append_jsonl
path = Path({str(path)!r})
append_jsonl(path, {{"i": 0, "pad": "x" * 3000}})
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))   # Python ignores SIGXFSZ: the write fails with EFBIG
try:
    append_jsonl(path, {{"i": 1, "pad": "x" * 3000}})
except OSError as e:
    print("refused:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert "refused:" in out.stdout, out.stdout + out.stderr
    data = path.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 1, (len(data), data[-40:])
    assert [r["i"] for r in read_jsonl(path)] == [0]


def test_run_files_are_as_readable_as_the_logs_beside_them(tmp_path):
    """config.yaml and manifest.json (written atomically, through a temporary file) get the mode a plain file
    gets under the umask, as metrics.jsonl does, not the temporary file's owner-only 0600."""
    run = RunDir.create("train", "modes", root=tmp_path, config={"seed": 1})
    append_jsonl(run.path / "metrics.jsonl", {"step": 1})
    modes = {p.name: p.stat().st_mode & 0o777 for p in run.path.iterdir() if p.name != LOCK_FILE}
    assert modes["config.yaml"] == modes["manifest.json"] == modes["metrics.jsonl"], modes


def test_a_root_that_is_a_file_is_named_as_such(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(CRRError, match=r"afile is a file, not a directory to make run directories in$"):
        RunDir.create("eval", "x", root=tmp_path / "afile")


def test_a_path_a_run_names_is_read_from_where_the_run_was_made(tmp_path, monkeypatch):
    from crr.rundir import as_made

    (tmp_path / "project" / "models" / "m").mkdir(parents=True)
    run = tmp_path / "project" / "results" / "runs" / "r"
    run.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert (tmp_path / as_made(run, "models/m")).resolve() == tmp_path / "project" / "models" / "m"
    assert as_made(run, "Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B" and as_made(run, None) is None
    monkeypatch.chdir(tmp_path / "project")
    assert as_made(run, "models/m") == "models/m"   # where it exists here, as it is
