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
