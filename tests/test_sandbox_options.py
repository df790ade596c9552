"""Fork engine options are checked for their type and range where they are declared (an engine class's
OPTIONS, crr.sandbox.engines.Option), before anything starts: a bad value is one CRRError line (exit 2)
naming the option, its value and what it takes, never a traceback, a sandbox whose every command fails
(`ulimit: bad number`) or a run whose every trajectory is an infra error."""

from __future__ import annotations

import inspect

import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.errors import CRRError
from crr.sandbox import RAY_OPTIONS, engine_class, engine_spec, get_engine, parse_options

BAD = [  # engine, --engine-opt, what the message says the option takes
    ("local", "mem_limit_mb=abc", "mem_limit_mb='abc': must be a whole number >= 1 (MB)"),
    ("local", "mem_limit_mb=-1", "mem_limit_mb=-1: must be a whole number >= 1 (MB)"),
    ("local", "mem_limit_mb=0", "mem_limit_mb=0: must be a whole number >= 1 (MB)"),
    ("local", "fsize_limit_mb=abc", "fsize_limit_mb='abc': must be a whole number >= 1 (MB)"),
    ("local", "disk_limit_mb=-5", "disk_limit_mb=-5: must be a whole number >= 1 (MB)"),
    ("local", "pids_limit=abc", "pids_limit='abc': must be a whole number >= 1"),
    ("local", "pids_limit=-3", "pids_limit=-3: must be a whole number >= 1"),
    ("local", "mem_limit_mb=true", "mem_limit_mb=True: must be a whole number >= 1 (MB)"),
    ("local", "mem_limit_mb=2.5", "mem_limit_mb=2.5: must be a whole number >= 1 (MB)"),
    ("local", "overlay=maybe", "overlay='maybe': must be true or false (or null)"),
    ("local", "record_http=maybe", "record_http='maybe': must be true or false"),
    ("local", "trust_task_code=2", "trust_task_code=2: must be true or false"),
    ("local", "workdir=", "workdir='': must be a path (or null)"),
    ("local", "rootfs=[1]", "rootfs=[1]: must be a path (or null)"),
    ("docker", "mode=fast", "mode='fast': choose commit or overlay"),
    ("docker", "flatten_depth=1",
     "flatten_depth=1: must be a whole number from 2 to 120 (overlay2 fails near 125 layers)"),
    ("docker", "cpus=0", "cpus=0: must be a number > 0"),
    ("docker", "pool_size=-1", "pool_size=-1: must be a whole number >= 0"),
    ("docker", "fsize_limit_mb=0", "fsize_limit_mb=0: must be a whole number >= 1 (MB)"),
    ("docker", "mem_limit=lots", "mem_limit='lots': must be a number of bytes or a size such as 4g"),
    ("docker", "mem_limit=4gb", "mem_limit='4gb': must be a number of bytes or a size such as 4g"),
    ("docker", "mem_limit=true", "mem_limit=True: must be a number of bytes or a size such as 4g"),
    ("ray:local", "cpus_per_sandbox=0", "cpus_per_sandbox=0: must be a number > 0"),
    ("ray:local", "call_timeout_s=soon", "call_timeout_s='soon': must be a number > 0 (s)"),
    ("ray:local", "mem_limit_mb=abc", "mem_limit_mb='abc': must be a whole number >= 1 (MB)"),  # inner's
]


@pytest.mark.parametrize(("engine", "pair", "says"), BAD, ids=[f"{e}-{p}" for e, p, _ in BAD])
def test_a_bad_value_is_refused_when_the_spec_is_checked_and_when_the_engine_is_made(engine, pair, says):
    options = parse_options([pair])   # as `--engine-opt` reads it (YAML: 2 an int, true a bool)
    with pytest.raises(CRRError) as spec:
        engine_spec(engine, options)
    assert str(spec.value) == f"fork engine {engine!r} option {says}"
    with pytest.raises(CRRError) as made:   # get_engine checks before it makes anything (or imports ray)
        get_engine(engine, **options)
    assert str(made.value) == str(spec.value)


def test_a_bad_value_is_one_line_and_exit_2_before_any_run_directory(tmp_path):
    for _, pair, says in [b for b in BAD if b[0] == "local"]:
        out = tmp_path / "runs"
        result = CliRunner().invoke(app, ["eval", "nano-test", "--engine-opt", pair, "--out", str(out)])
        assert (result.exit_code, result.output) == (2, f"error: fork engine 'local' option {says}\n"), pair
        assert not out.exists(), pair


def test_good_values_make_a_working_engine(make_task, tmp_path):
    options = parse_options(["mem_limit_mb=4096", "fsize_limit_mb=4", "disk_limit_mb=64", "pids_limit=256",
                             "overlay=false", "trust_task_code=true", "record_http=false",
                             f"workdir={tmp_path / 'sandboxes'}"])
    spec = engine_spec("local", options)
    assert spec.options["fsize_limit_mb"] == 4 and spec.options["overlay"] is False
    assert engine_spec("docker", {"mode": "overlay", "cpus": 0.5, "pool_size": 0, "image": None}).options
    assert all(engine_spec("docker", {"mem_limit": m}).options for m in ("4g", "512M", 2 ** 31))
    assert engine_spec("ray:local", {"cpus_per_sandbox": 2, "rescan_s": 0, "fsize_limit_mb": 8}).options
    with spec.make() as engine, engine.start(make_task({"a.txt": "a\n"})) as sb:
        ran = sb.exec("head -c 1000000 /dev/zero > small && wc -c < small && ls a.txt")
        assert ran.exit_code == 0 and ran.output.split() == ["1000000", "a.txt"], ran.output
        big = sb.exec("head -c 8000000 /dev/zero > big")   # past fsize_limit_mb=4: ulimit took the cap
        assert big.exit_code != 0 and "bad number" not in big.output, big.output


def test_a_workdir_the_engine_cannot_make_is_one_line(tmp_path):
    """workdir is a path on the machine that makes the engine (a Ray node, for ray:local): checked there.
    (A rootfs without a root file system is no error: the engine says so and contains less, as documented.)"""
    (tmp_path / "file").write_text("")
    with pytest.raises(CRRError, match=r"^fork engine 'local' workdir '.*file/sub': cannot make it \(Not a "):
        get_engine("local", workdir=tmp_path / "file" / "sub")


@pytest.mark.parametrize("name", ["local", "docker"])
def test_every_option_of_an_engine_is_declared(name):
    """A new constructor keyword needs its line in OPTIONS."""
    cls = engine_class(name)
    takes = set(inspect.signature(cls).parameters)
    assert takes == set(cls.OPTIONS)


def test_every_option_of_the_ray_wrapper_is_declared():
    ray_engine = pytest.importorskip("crr.sandbox.ray_engine")
    params = inspect.signature(ray_engine.RayEngine).parameters
    assert {p for p, v in params.items() if v.kind is v.KEYWORD_ONLY} - {"factory"} == set(RAY_OPTIONS)



def test_a_flag_and_an_engine_option_that_disagree_are_refused(tmp_path):
    # --mode and --ray are sugar for the options mode= and address=: given both ways on one command line, differently,
    # neither silently wins
    out = tmp_path / "runs"
    for args, says in (
            (["--engine", "docker", "--mode", "commit", "--engine-opt", "mode=overlay"],
             "--mode commit and --engine-opt mode=overlay disagree; give one of them"),
            (["--engine", "ray:local", "--ray", "local", "--engine-opt", "address=auto"],
             "--ray local and --engine-opt address=auto disagree; give one of them")):
        result = CliRunner().invoke(app, ["eval", "nano-test", *args, "--out", str(out)])
        assert (result.exit_code, result.output) == (2, f"error: {says}\n"), args
        assert not out.exists()
    # the same value both ways is one setting
    from crr.cli.common import engine_settings
    assert engine_settings("docker", ["mode=overlay"], mode="overlay") == {
        "engine": "docker", "engine_options": {"mode": "overlay"}, "mode": "overlay"}
