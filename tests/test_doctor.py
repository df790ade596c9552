import json

import pytest
from typer.testing import CliRunner

from crr import doctor
from crr.cli import app


def test_required_checks_pass_on_a_set_up_machine():
    checks = {c.name: c for c in doctor.run_checks()}
    for name in ("python", "torch", "trl", "swebench", "free disk"):
        assert checks[name].ok, checks[name]


@pytest.mark.docker
def test_docker_checks_pass_when_the_daemon_runs():
    checks = {c.name: c for c in doctor.run_checks()}
    assert checks["docker daemon"].ok and checks["base image"].ok


@pytest.mark.docker
def test_a_missing_base_image_is_reported_with_its_fix(monkeypatch):
    monkeypatch.setattr(doctor, "BASE_IMAGE", "crr-base:does-not-exist")
    result = CliRunner().invoke(app, ["doctor", "--json"])
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["base image"]["ok"] is False
    assert "build-base-image.sh" in rows["base image"]["fix"]
    assert result.exit_code == 0  # Docker is optional: the local engine needs none of it


def test_a_missing_required_package_fails_the_command(monkeypatch):
    monkeypatch.setattr(doctor, "_python", lambda: doctor.Check("python", False, "3.9", "install Python >= 3.11"))
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 1
    assert "install Python" in result.stdout


def test_the_bf16_check_reads_the_cpu_flags_and_names_the_fp32_settings(tmp_path, monkeypatch):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert doctor.cpu_flags(str(x86)) == {"fpu", "sse2", "avx2", "avx512f"}   # the first processor's
    assert doctor.cpu_flags(str(tmp_path / "absent")) is None
    assert doctor._bf16(False, doctor.cpu_flags(str(arm))) == doctor.Check("bf16 arithmetic", True, "native (bf16)",
                                                                             required=False)
    assert doctor._bf16(False, {"avx512_bf16", "amx_bf16"}).detail == "native (amx_bf16, avx512_bf16)"
    assert doctor._bf16(True, set()).ok and doctor._bf16(False, None).ok
    emulated = doctor._bf16(False, doctor.cpu_flags(str(x86)))
    assert not emulated.ok and not emulated.required
    assert "dtype=float32" in emulated.fix and "--dtype float32" in emulated.fix
    # optional: a CPU without native bf16 runs everything, more slowly, so the command still succeeds
    monkeypatch.setattr(doctor, "cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    result = CliRunner().invoke(app, ["doctor", "--json"])
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows["bf16 arithmetic"]["ok"] is False and result.exit_code == 0
