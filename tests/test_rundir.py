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
