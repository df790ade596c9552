"""`--engine ray:local --ray ADDRESS` through the commands (issue 12): `crr filter-tasks` and `crr eval` on a
two-node Ray cluster decide exactly what they decide on the local engine, their workers sized to the
cluster's sandbox slots; a `crr train` CRR run forking on the cluster's two nodes gives the local run's
rollouts, forks, advantages and updates; `--ray` beside an engine that takes none is one line and exit 2;
and without a Ray engine nothing imports ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from crr.cli import app
from crr.errors import CRRError
from crr.eval.evaluate import RESULTS, TRANSCRIPTS
from crr.sandbox import EngineSpec, engine_spec, engine_workers
from crr.rundir import RunDir
from crr.train.tuples import read_tuples

ROOT = Path(__file__).resolve().parents[1]
NO_RAY = ("import sys\nfrom typer.testing import CliRunner\nfrom crr.cli import app\n"
          "result = CliRunner().invoke(app, sys.argv[1:])\nassert result.exit_code == 0, result.output\n"
          "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")


def crr(*args: str):
    return CliRunner().invoke(app, list(args))


def ray_modules(*argv: str) -> str:
    """The ray modules a fresh interpreter has imported after running `crr ARGV` (asserting it succeeded)."""
    out = subprocess.run([sys.executable, "-c", NO_RAY, *argv], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out.stdout.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------ no cluster needed

def test_the_engine_spec_is_the_one_translation_of_the_settings():
    """--ray and --mode are sugar over the options address and mode; the engine checks every option."""
    assert engine_spec("local").options == {} and engine_spec("docker", mode="overlay").options == {"mode": "overlay"}
    assert engine_spec("ray:local") == EngineSpec("ray:local", {})   # RayEngine's own default address: auto
    assert engine_spec("ray:docker", {"cpus_per_sandbox": 0.5}, ray="10.0.0.1:6379", mode="commit").options == {
        "cpus_per_sandbox": 0.5, "address": "10.0.0.1:6379", "mode": "commit"}
    with pytest.raises(CRRError, match=r"--ray auto\) applies to a ray:<engine> engine only"):
        engine_spec("local", ray="auto")
    with pytest.raises(CRRError, match="'ray:local' takes no option mode"):
        engine_spec("ray:local", mode="overlay")
    with pytest.raises(CRRError, match="commit or overlay"):
        engine_spec("ray:docker", mode="fast")


def test_workers_follow_the_engines_slots_unless_given():
    class Slotted:
        slots = 12

    assert engine_workers(Slotted(), None, 4) == 12 and engine_workers(Slotted(), 3, 4) == 3
    assert engine_workers(object(), None, 4) == 4   # the local and Docker engines have no slots


def test_the_address_is_a_config_key_of_every_run(tmp_path):
    """`ray` in the training config (presets and key=value overrides), an eval config, an SFT recipe and a
    comparison's eval entry, where a ray: engine takes it and nowhere else."""
    from crr.eval.evaluate import EvalConfig
    from crr.experiments import _eval_spec
    from crr.sft.warm_start import SFTRecipe
    from crr.train.config import load_config, parse_overrides

    overrides = parse_overrides(["engine=ray:docker", "ray=10.0.0.1:6379"])
    cfg = load_config(None, {**overrides, "output_dir": str(tmp_path)})
    assert cfg.resolved()["ray"] == "10.0.0.1:6379" and cfg.workers is None   # unset: the cluster's slots
    assert load_config(None, {"output_dir": str(tmp_path)}).ray is None
    with pytest.raises(CRRError, match="applies to a ray:<engine> engine only"):
        load_config(None, {"ray": "auto", "output_dir": str(tmp_path)})
    with pytest.raises(CRRError, match="applies to a ray:<engine> engine only"):
        EvalConfig(dataset="d", tasks="t", ray="auto")
    with pytest.raises(CRRError, match="applies to a ray:<engine> engine only"):
        SFTRecipe.from_dict({"ray": "auto"})
    assert SFTRecipe.from_dict({"engine": "ray:local", "ray": "auto"}).ray == "auto"
    # the same engine spec everywhere: a name, its options, --mode as sugar; the engine checks the options
    given = parse_overrides(["engine=docker", "mode=overlay", "engine_options={image: x, cpus: 2}"])
    cfg = load_config(None, {**given, "output_dir": str(tmp_path)})
    assert (cfg.engine, cfg.mode, cfg.engine_options) == ("docker", "overlay", {"image": "x", "cpus": 2})
    with pytest.raises(CRRError, match="'docker' takes no option memory"):
        EvalConfig(dataset="d", tasks="t", engine="docker", engine_options={"memory": "4g"})
    spec = _eval_spec(tmp_path / "x.comparison.yaml", {"dataset": "nano-test", "engine": "ray:local",
                                                       "ray": "auto"})
    assert spec.eval_args("RUN")[-6:-2] == ["--engine", "ray:local", "--ray", "auto"]
    spec = _eval_spec(tmp_path / "x.comparison.yaml", {"dataset": "nano-test", "engine": "docker", "mode": "overlay",
                                                       "engine_options": {"mem_limit": "4g", "cpus": 2}})
    assert spec.eval_args("RUN")[4:12] == ["--engine", "docker", "--engine-opt", "mem_limit=4g", "--engine-opt",
                                           "cpus=2", "--mode", "overlay"]


def test_ray_beside_another_engine_is_one_line_and_exit_2(tmp_path):
    for args in (["filter-tasks", "--tasks", "nano-band", "--engine", "local", "--ray", "auto"],
                 ["eval", "nano-test", "--ray", "auto"],
                 ["tool", "--tasks", "nano-band", "--instance", "x", "--engine", "docker", "--ray", "auto",
                  "--call", "{}"],
                 ["tasks", "synth", "--package", "x==1", "--ray", "auto", "--out", str(tmp_path / "synth")]):
        result = crr(*args, "--out", str(tmp_path / "runs")) if args[0] == "filter-tasks" else crr(*args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (args, result.output)
        assert "applies to a ray:<engine> engine only" in lines[0], (args, result.output)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "synth").exists()
    mode = crr("tool", "--tasks", "nano-band", "--instance", "x", "--engine", "ray:docker", "--mode", "fast",
               "--call", "{}")
    assert mode.exit_code == 2 and "choose commit or overlay" in mode.output   # --mode is taken on ray:docker
    opt = crr("tool", "--tasks", "nano-band", "--instance", "x", "--engine", "docker", "--engine-opt", "memory=4g",
              "--call", "{}")
    assert opt.exit_code == 2 and "'docker' takes no option memory" in opt.output   # checked by the engine


def test_an_address_where_no_ray_answers_is_one_line_and_exit_2():
    """`--ray HOST:PORT` where nothing listens, or a server that is not Ray: crr's one line at once, not minutes of
    Ray's C++ client retrying on stderr (a subprocess: that client writes to the process's file descriptor 2)."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from crr.tasks.loaders import load_tasks

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    web = HTTPServer(("0.0.0.0", 0), SimpleHTTPRequestHandler)   # Ray dials the node's IP for 127.0.0.1
    threading.Thread(target=web.serve_forever, daemon=True).start()
    call = json.dumps({"name": "view_file", "arguments": {"path": "setup.py"}})
    try:
        for port in (free, web.server_port):
            out = subprocess.run([sys.executable, "-m", "crr", "tool", "--tasks", "nano-band", "--instance",
                                  load_tasks("nano-band")[0].instance_id, "--engine", "ray:local", "--ray",
                                  f"127.0.0.1:{port}", "--call", call], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
            lines = (out.stdout + out.stderr).strip().splitlines()
            assert out.returncode == 2 and len(lines) == 1, out.stdout + out.stderr
            assert lines[0].startswith(f"error: cannot connect to a Ray cluster at '127.0.0.1:{port}': no Ray "
                                       "cluster answers at "), lines
    finally:
        web.shutdown()
        web.server_close()


def test_without_a_ray_engine_ray_is_never_imported(tmp_path):
    """Neither the help of the commands that take --ray, nor a command run on the local engine (with the
    option handling of crr.sandbox.engine_spec), imports ray."""
    for argv in (["eval", "--help"], ["filter-tasks", "--help"], ["tasks", "synth", "--help"]):
        assert ray_modules(*argv) == "[]", argv
    call = json.dumps({"name": "view_file", "arguments": {"path": "setup.py"}})
    from crr.tasks.loaders import load_tasks

    instance = load_tasks("nano-band")[0].instance_id
    assert ray_modules("tool", "--tasks", "nano-band", "--instance", instance, "--engine", "local",
                       "--call", call, "--json") == "[]"


# ------------------------------------------------------------------------------------ on a Ray cluster

def test_filter_tasks_on_ray_admits_what_local_admits(cluster, tmp_path, caplog):
    """`crr filter-tasks --engine ray:local --ray ADDRESS` on shipped nano-band tasks: the same verdicts as
    `--engine local`, with as many workers as the cluster has sandbox slots (2 nodes x 1: one CPU each)."""
    verdicts = {}
    for engine in ("local", "ray:local"):
        ray = ["--ray", cluster.address] if engine.startswith("ray:") else []
        with caplog.at_level("INFO", logger="crr.filter.determinism"):
            result = crr("filter-tasks", "--tasks", "nano-band", "--limit", "2", "--reruns", "2", "--timeout", "120",
                         "--engine", engine, *ray, "--out", str(tmp_path / engine.replace(":", "-")))
        assert result.exit_code == 0, result.output
        (run_dir,) = (tmp_path / engine.replace(":", "-")).iterdir()
        run = RunDir.open(run_dir)
        verdicts[engine] = {r["instance_id"]: (r["verdict"], r["reason"]) for r in run.records("results.jsonl")}
        if ray:
            assert run.config["ray"] == cluster.address and run.config["engine"] == "ray:local"
    assert "with 2 workers on the ray:local engine" in caplog.text
    resumed = crr("filter-tasks", "--resume", str(run.path), "--ray", "auto")   # another address: where, not what
    assert resumed.exit_code == 0, resumed.output
    assert len(verdicts["local"]) == 2 and verdicts["ray:local"] == verdicts["local"]
    assert any(v == "admitted" for v, _ in verdicts["local"].values())


def test_eval_on_ray_gives_the_local_pass_rate_and_trajectories(cluster, tmp_path):
    """`crr eval` greedy with the shipped default model (in float32, as the training test below) on 2 tasks, same
    seed: through ray:local the same pass@1, the same results (patches, rewards, turns) and the same transcripts as
    on the local engine; the run keeps its --ray, and resuming it keeps it too."""
    runs = {}
    for engine in ("local", "ray:local"):
        ray = ["--ray", cluster.address] if engine.startswith("ray:") else []
        result = crr("eval", "nano-test", "--n-tasks", "2", "--max-turns", "3", "--max-new-tokens", "96",
                     "--dtype", "float32", "--engine", engine, *ray, "--out", str(tmp_path / engine.replace(":", "-")),
                     "--json")
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        runs[engine] = (summary, RunDir.open(summary["run_dir"]))
    (local, local_run), (on_ray, ray_run) = runs["local"], runs["ray:local"]
    assert on_ray["pass_at_1"] == local["pass_at_1"] and on_ray["scored"] == local["scored"] == 2
    keep = ("instance_id", "reward", "end_reason", "turns", "model_patch", "generated_tokens", "seed")
    assert ([{k: r[k] for k in keep} for r in ray_run.records(RESULTS)]
            == [{k: r[k] for k in keep} for r in local_run.records(RESULTS)])
    assert ray_run.records(TRANSCRIPTS) == local_run.records(TRANSCRIPTS)
    assert any(r["model_patch"] for r in local_run.records(RESULTS))   # edits made and graded, not only views
    assert ray_run.config["ray"] == cluster.address and ray_run.config["workers"] is None
    again = crr("eval", "--resume", str(ray_run.path), "--json")   # nothing left to run; the address stays
    assert again.exit_code == 0 and RunDir.open(ray_run.path).config["ray"] == cluster.address


# the trainer's timings: everything else of an iteration's record is a function of the seed
TIMINGS = ("time", "fork_share", "cf_share")


def train_records(run: RunDir) -> tuple[list[dict], list[dict]]:
    """A train run's iteration records without their timings, and its TRL update records' loss and grad norm."""
    iterations, updates = [], []
    for r in run.records("metrics.jsonl"):
        if r.get("event") == "iteration":
            ledger = {k: v for k, v in r["ledger"].items() if not k.endswith("_s")}   # counts, not seconds
            iterations.append({**{k: v for k, v in r.items() if k not in TIMINGS}, "ledger": ledger})
        elif r.get("event") == "trl" and "loss" in r:
            updates.append({k: r[k] for k in ("step", "loss", "grad_norm", "kl", "entropy")})
    return iterations, updates


def test_crr_training_on_ray_gives_the_local_advantages(cluster, tmp_path, caplog):
    """`crr train` method=crr with the shipped default model on 2 nano-band tasks, 2 updates, same seed: with
    sandboxes on the cluster's two nodes (engine=ray:local, 2 workers: its slots) every iteration record
    (rewards, group rewards, selected steps, branches, forks, counterfactual rewards, advantage mean, std and
    nonzero share, contrasts, the ledger's counts), every tuple (realised and counterfactual actions and
    suffixes, rewards, proposal log-probabilities) and every update's loss equal the local engine's (4
    workers). eta=0 and k=2 make the selector pick steps, so branches run and forks happen. Both train the
    default's bf16 weights in fp32 (`dtype=float32`; this CPU emulates bf16), as the run's summary records."""
    runs = {}
    for engine in ("local", "ray:local"):
        ray = [f"ray={cluster.address}"] if engine.startswith("ray:") else []
        out = tmp_path / engine.replace(":", "-")
        with caplog.at_level("INFO", logger="crr.sandbox.ray_engine"):
            result = crr("train", "--method", "crr", "--out", str(out), "--max-updates", "2", "tasks=nano-band",
                         "n_tasks=2", "tasks_per_iteration=2", "num_generations=2", "max_turns=4",
                         "max_new_tokens=96", "k=2", "eta=0.0", "dtype=float32", f"engine={engine}", *ray)
        assert result.exit_code == 0, result.output + repr(result.exception)
        (run_dir,) = out.glob("*-train-*")
        runs[engine] = RunDir.open(run_dir)
    assert "ray:local: sandbox hosts on 2 nodes" in caplog.text   # the sandboxes were spread over both
    assert runs["ray:local"].config["ray"] == cluster.address
    # the shipped default's bf16 weights trained in fp32 (dtype=float32: bf16 is emulated on AVX2-only CPUs)
    assert [json.loads((run.path / "summary.json").read_text())["dtype"] for run in runs.values()] == ["float32"] * 2
    (local_iters, local_updates), (ray_iters, ray_updates) = map(train_records, runs.values())
    assert [r["step"] for r in local_iters] == [1, 2] and [u["step"] for u in local_updates] == [1, 2]
    assert sum(r["ledger"]["forks"] for r in local_iters) > 0 and any(r["adv_nonzero"] for r in local_iters)
    assert ray_iters == local_iters and ray_updates == local_updates
    cols = ["iteration", "task_id", "row", "t", "steps", "realised_action", "counterfactual_action", "prefix_actions",
            "realised_suffix", "counterfactual_suffix", "reward", "cf_reward", "cf_end_reason", "proposal_logprob",
            "selector_score", "k_index", "prefix_signature"]
    local_tuples, ray_tuples = (read_tuples(run.path)[cols] for run in runs.values())
    assert len(local_tuples) == sum(r["ledger"]["forks"] for r in local_iters)
    for frame in (local_tuples, ray_tuples):   # the suffixes read back as arrays: compare them as tuples
        for col in ("prefix_actions", "realised_suffix", "counterfactual_suffix"):
            frame[col] = frame[col].map(tuple)
    pd.testing.assert_frame_equal(ray_tuples, local_tuples)
