"""The evaluation runner (paper: Experiments, "greedy pass@1 with a 50-turn cap"; Supplementary
"Multiple-sample evaluation", eight samples at T = 0.6): roll the policy out on a benchmark's tasks,
grade every final state with the verifier (swebench's grading, each task's own log parser), and write
an eval run directory that `crr report` reads.

    policy = resolve_policy(run="results/runs/...-train-crr-seed11")    # or model=..., or the default
    config = EvalConfig(*benchmark("micro"), policy=policy, samples=1, temperature=0.0)
    run = start_eval(config, out="results/evals")
    summary = evaluate(config, run)

The run directory (the format crr report reads):
  config.yaml         the EvalConfig: dataset, tasks source, model, train_run, checkpoint, method,
                      train_seed, samples, temperature, seed, max_turns, engine, ...
  results.jsonl       one record per (instance, sample), appended as each finishes: reward (after the
                      harness audit; None for an infrastructure failure), resolution, end_reason, turns,
                      generated tokens, the model patch, error_mode and the held-out test counts
  transcripts.jsonl   each sample's tool calls and observations (what the taxonomy's audit reads), appended
                      just before its result; a sample run again (resumed, or retried) has the last one of its key
  predictions.jsonl   SWE-bench predictions of sample 0 (instance_id, model_name_or_path, model_patch),
                      so that the official harness can grade them too
  summary.json        pass@1, pass@k, pass^k, all-n, per-repository pass@1, each with its Wilson interval
                      (`*_ci`), error modes (crr.eval.passk, .stats, .taxonomy)
  infra_retried.jsonl infrastructure-failure records set aside when their samples were run again

Resume: evaluating into an existing run directory (`resume_eval`) runs only the (instance, sample) pairs
without a record, plus, with retry_infra, those whose record is an infrastructure failure. Samples are
run in chunks of `batch` episodes (one generation batch, one sandbox each); chunk c of pass p samples
with seed derive_seed(seed, p, c) (crr.seeds), recorded on every result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import yaml

from crr.errors import CRRError
from crr.eval.passk import summarise_samples
from crr.eval.taxonomy import error_mode, held_out_counts, summarise_modes
from crr.policy import DTYPES, SERVER_BACKEND, check_backend, check_model
from crr.sandbox import engine_spec_of
from crr.rundir import RunDir, as_made
from crr.seeds import check_seed, derive_seed
from crr.tasks.loaders import TASK_SETS, dataset_adapter, load_tasks
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
TRANSCRIPTS = "transcripts.jsonl"
PREDICTIONS = "predictions.jsonl"
SUMMARY = "summary.json"
INFRA_RETRIED = "infra_retried.jsonl"
DEFAULT_OUT = Path("results/evals")
SAMPLED_TEMPERATURE = 0.6  # the paper's multi-sample evaluation

ALIASES = {"micro": "micro-test"}   # crr eval's benchmark names: these and crr.tasks.loaders.TASK_SETS


def benchmark(name: str, path: str | None = None) -> tuple[str, str, str | None]:
    """(dataset label, tasks source, adapter) of `crr eval NAME [FILE]`: a named task set (FILE: a local
    copy of a hub dataset, a save_to_disk directory or .parquet file), or `tasks FILE`."""
    name = ALIASES.get(name, name)
    if name == "tasks":
        if path is None:
            raise CRRError("`crr eval tasks FILE` needs the task file (JSONL) or directory")
        return Path(path).stem or Path(path).resolve().name, path, None
    if name not in TASK_SETS:
        raise CRRError(f"unknown benchmark {name!r}; use one of {', '.join([*ALIASES, *TASK_SETS])}, "
                       "or `tasks FILE` for a task file")
    dataset = TASK_SETS[name].dataset
    if dataset is None:
        if path is not None:
            raise CRRError(f"{name} is one of crr's task sets and takes no FILE; use `crr eval tasks {path}`")
        return name, name, None
    return name, path if path is not None else dataset, dataset_adapter(dataset)


# ------------------------------------------------------------------------------------ the policy

@dataclass
class Policy:
    model: str                      # what is evaluated: a model directory or hub id, or a PEFT adapter
    base_model: str | None = None   # the model an adapter applies to
    train_run: str | None = None
    checkpoint: str | None = None
    method: str | None = None
    train_seed: int | None = None


def resolve_policy(model: str | None = None, run: Path | str | None = None,
                   checkpoint: str | None = None) -> Policy:
    """The policy to evaluate: `model` (a directory or hub id), a `crr train` run's model/ or
    checkpoints/checkpoint-N (`checkpoint` N, or a path), or the embedded default (the warm-started
    default when it has been built, else the tiny default, as crr train chooses)."""
    from crr.train.trainer import CHECKPOINTS, resolve_model  # deferred: torch and TRL (`crr eval --help`)

    if model is not None and run is not None:
        raise CRRError("give --model or --run, not both")
    if run is None:
        if checkpoint is not None and not Path(checkpoint).is_dir():
            raise CRRError(f"--checkpoint {checkpoint}: no such directory; a checkpoint number needs --run RUN_DIR")
        # crr train's own choice when its config leaves `model` unset
        target = str(checkpoint or model or resolve_model(SimpleNamespace(model=None)))
        check_model(target, f"--checkpoint {target}" if checkpoint else f"--model {target}", adapter=True)
        if not Path(target).expanduser().is_dir():
            return Policy(model=_hub_model(target))
        return Policy(model=target, base_model=_adapter_base(Path(target).expanduser(), None, resolve_model))

    train = RunDir.open(run)
    cfg = train.config
    if checkpoint is None:
        target = train.path / "model"
    else:
        target = train.path / CHECKPOINTS / f"checkpoint-{checkpoint}" if checkpoint.isdigit() else Path(checkpoint)
    if not target.is_dir():
        steps = sorted(int(m.group(1)) for p in (train.path / CHECKPOINTS).glob("checkpoint-*")
                       if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)))
        missing = "model/ (did training finish?)" if checkpoint is None else "such checkpoint"
        raise CRRError(f"{target} does not exist: the run has no {missing}; pick one with --checkpoint N "
                       f"(checkpoints: {', '.join(map(str, steps)) or 'none'})")
    return Policy(model=str(target), base_model=_adapter_base(target, cfg.get("model"), resolve_model),
                  train_run=str(train.path), checkpoint=None if checkpoint is None else str(target),
                  method=cfg.get("method"), train_seed=cfg.get("seed"))


def _hub_model(name: str) -> str:
    """A hub id whose config loads (offline: from the local Hugging Face cache), so that one that does not fails
    before the evaluation's run directory exists."""
    from transformers import AutoConfig  # deferred: transformers (`crr eval --help`)

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:  # unknown hub id, not in the cache offline
        raise CRRError(f"cannot load a model from {name!r} ({' '.join(str(e).split())}); pass a model or LoRA "
                       "adapter directory or a hub id that is in the local Hugging Face cache") from None
    return name


def _adapter_base(target: Path, configured: str | None, resolve_model: Callable) -> str | None:
    """None for a full model directory; for a PEFT adapter (crr train with use_lora) the model it was
    trained on: the train config's `model`, else the base recorded in adapter_config.json, else crr
    train's default."""
    if (target / "adapter_config.json").is_file():
        recorded = json.loads((target / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if configured:
            return configured
        if recorded and (Path(recorded).is_dir() or not recorded.startswith(("/", ".", "~"))):
            return recorded
        return resolve_model(SimpleNamespace(model=None))
    if (target / "config.json").is_file():
        return None
    raise CRRError(f"{target} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json)")


def load_eval_policy(policy: Policy, device: str = "cpu", dtype: str = "auto"):
    """(model, tokenizer) ready for generation, the weights in `dtype` (DTYPES); an adapter is merged into its
    base model."""
    from crr.policy.model import load_policy  # deferred: torch and transformers

    if policy.base_model is None:
        return load_policy(policy.model, device, dtype)
    from peft import PeftModel

    base, tokenizer = load_policy(policy.base_model, device, dtype)
    try:
        model = PeftModel.from_pretrained(base, policy.model).merge_and_unload()
    except (OSError, ValueError, RuntimeError) as e:  # missing weights, shape mismatch with the base
        raise CRRError(f"cannot apply the LoRA adapter {policy.model} to {policy.base_model} ({e}); "
                       "is that the model it was trained on?") from None
    return model.eval(), tokenizer


# ------------------------------------------------------------------------------------ config and run

@dataclass
class EvalConfig:
    dataset: str                    # the benchmark's label: micro-test, verified, live, rebench, gym, a file's name
    tasks: str                      # the tasks source given to crr.tasks.loaders.load_tasks
    adapter: str | None = None      # its dataset adapter
    split: str | None = None
    n_tasks: int | None = None      # the first N tasks (None: all)
    model: str = ""
    base_model: str | None = None
    train_run: str | None = None
    checkpoint: str | None = None
    method: str | None = None
    train_seed: int | None = None
    samples: int = 1                # n per instance
    temperature: float = 0.0        # 0: greedy
    seed: int = 0
    max_turns: int = 50             # H
    max_new_tokens: int = 512
    engine: str = "local"           # the engine spec (crr.sandbox.engines): a name or pkg.module:Class,
    engine_options: dict = field(default_factory=dict)  # its options,
    ray: str | None = None          # a ray:... engine's cluster address (None: auto),
    mode: str | None = None         # and the Docker engine's mode (commit or overlay)
    workers: int | None = None      # concurrent tool executions (None: 4, or a Ray engine's sandbox slots)
    batch: int = 32                 # episodes run together
    agent_format: str = "paper"     # crr.agent.prompt.FORMATS (EvalConfig.make: the model's recorded one)
    backend: str = "transformers"   # generation: transformers, vllm (crr.policy.backend.VLLMBackend) or
    #                                 vllm-server (VLLMServerBackend: a running vLLM server, TRL's server mode)
    vllm_server: str | None = None  # backend vllm-server: the server's URL
    dtype: str = "auto"             # the weights' dtype: auto (as saved; EvalConfig.make: a train run's), float32,
    #                                 bfloat16 (crr train's `dtype`)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CRRError(f"--dtype is one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.samples < 1:
            raise CRRError(f"--samples must be at least 1, got {self.samples}")
        if not 0 <= self.temperature < float("inf"):   # (nan too)
            raise CRRError(f"--temperature must be a number >= 0, got {self.temperature}")
        if self.samples > 1 and self.temperature == 0:
            raise CRRError(f"--samples {self.samples} at temperature 0 gives {self.samples} copies of the greedy "
                           f"sample; pass --temperature (the paper samples at {SAMPLED_TEMPERATURE})")
        for name in ("max_turns", "max_new_tokens", "workers", "batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise CRRError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_tasks is not None and self.n_tasks < 1:
            raise CRRError(f"--n-tasks must be at least 1, got {self.n_tasks}")
        check_seed(self.seed, "--seed")
        engine_spec_of(self)  # an option the engine does not take fails here
        check_backend(self.backend, self.vllm_server, options=True)

    @classmethod
    def make(cls, dataset: str, tasks: str, adapter: str | None, policy: Policy, **settings) -> EvalConfig:
        """Settings left out (or None) take the policy's agent record (the format, and H, it was trained
        with), then the defaults above; the temperature is greedy for one sample, SAMPLED_TEMPERATURE for
        several."""
        from crr.policy.model import agent_record  # here: it imports torch, which `crr eval --help` need not

        settings = {k: v for k, v in settings.items() if v is not None}
        settings.setdefault("temperature", 0.0 if settings.get("samples", 1) == 1 else SAMPLED_TEMPERATURE)
        record = agent_record(policy.model, policy.base_model)
        if policy.train_run:  # what the run trained with
            trained = RunDir.open(policy.train_run).config
            record.update({k: trained[k] for k in ("agent_format", "max_turns", "dtype") if trained.get(k) is not None})
        for key in ("agent_format", "max_turns", "dtype"):
            if settings.get(key) is None and key in record:
                settings[key] = record[key]
        return cls(dataset=dataset, tasks=tasks, adapter=adapter, **asdict(policy), **settings)


# Settings a resumed evaluation may change: how and where it runs (a vLLM server restarted elsewhere too),
# and a larger task set.
_RESUMABLE = ("workers", "batch", "ray", "n_tasks", "vllm_server")
MERGED_MODEL = "merged-model"   # a LoRA policy's merged weights, saved for vLLM (which loads a directory)


def start_eval(config: EvalConfig, out: Path | str = DEFAULT_OUT) -> RunDir:
    label = Path(config.train_run).name if config.train_run else Path(config.model).name
    if config.checkpoint:
        label += f"-{Path(config.checkpoint).name}"
    name = re.sub(r"[^\w.-]+", "-", f"{config.dataset}-{label}")
    return RunDir.create("eval", name, root=out, config=asdict(config), seeds={"eval": config.seed})


def open_eval(dataset: str | None, file: str | None = None, *, model: str | None = None,
              run_dir: Path | str | None = None, checkpoint: str | None = None, out: Path | str = DEFAULT_OUT,
              resume: Path | str | None = None, **settings) -> tuple[EvalConfig, RunDir]:
    """`crr eval`'s config and run directory: a new evaluation of the policy (`resolve_policy`) on the
    benchmark (`benchmark`; micro when None), or with `resume` an earlier one, which the given settings
    (None: not given) must agree with. A new one's bad tasks fail before its run directory exists."""
    if resume is not None:
        if dataset is not None:
            settings.update(zip(("dataset", "tasks", "adapter"), benchmark(dataset, file)))
        if model is not None or run_dir is not None or checkpoint is not None:
            settings["model"] = resolve_policy(model, run_dir, checkpoint).model
        config, run = resume_eval(resume, settings)
        check_eval_server(config, run)
        return config, run
    engine_spec_of(settings)  # before the policy loads
    label, source, adapter = benchmark(dataset or "micro", file)
    config = EvalConfig.make(label, source, adapter, resolve_policy(model, run_dir, checkpoint), **settings)
    load_eval_tasks(config)
    check_eval_server(config)
    return config, start_eval(config, out)


def check_eval_server(config: EvalConfig, run: RunDir | None = None) -> None:
    """With backend vllm-server, before anything is run: a CRRError unless a vLLM server with crr's grammar
    processor answers at config.vllm_server (crr.policy.backend.probe_vllm_server), serves the evaluated model
    directory (for a LoRA policy: its merged weights, which the evaluation saves in its run directory, so that
    is checked once they are saved: `_server_backend`), and this interpreter can run TRL's client (vllm)."""
    if config.backend != SERVER_BACKEND:
        return
    import importlib.util

    from crr.policy.backend import check_served_model, probe_vllm_server

    info = probe_vllm_server(config.vllm_server)
    if config.base_model is None:
        check_served_model(info, config.model, config.vllm_server)
    elif run is not None and (run.path / MERGED_MODEL / "config.json").is_file():
        check_served_model(info, str(run.path / MERGED_MODEL), config.vllm_server, _serve_merged(config, run))
    if importlib.util.find_spec("vllm") is None:
        raise CRRError("--backend vllm-server generates through TRL's VLLMClient, which needs vllm importable in the "
                       "client's interpreter too: run crr eval in .venv-vllm on CPU (scripts/setup-vllm.sh), or "
                       "install crr[gpu]")


def _serve_merged(config: EvalConfig, run: RunDir) -> str:
    merged = run.path / MERGED_MODEL
    return (f"this evaluation's policy is the LoRA adapter {config.model} on {config.base_model}, and a server "
            f"loads whole weights: they are merged into {merged}; start the vLLM server with --model {merged} "
            f"and resume with `crr eval --resume {run.path} --vllm-server URL`")


def resume_eval(path: Path | str, overrides: dict | None = None) -> tuple[EvalConfig, RunDir]:
    """The config and run directory of an earlier evaluation. `overrides` (None: not given) must agree
    with its config, except workers, batch, ray, vllm_server and a larger n_tasks."""
    run = RunDir.open(path)
    if run.manifest.get("command") != "eval":
        raise CRRError(f"{path} is a `crr {run.manifest.get('command')}` run, not an evaluation; --resume takes "
                       "a directory made by crr eval")
    run.lock()
    try:
        config = EvalConfig(**run.config)
    except TypeError as e:   # keys missing or unknown
        raise CRRError(f"{run.path / 'config.yaml'} is corrupt (not an evaluation's config: {e})") from None
    for key, value in (overrides or {}).items():
        current = getattr(config, key)
        if value is None or value == current:
            continue
        if key == "n_tasks" and (current is None or value < current):
            which = "all" if current is None else f"the first {current}"
            raise CRRError(f"{path} evaluates {which} tasks; --n-tasks can grow on resume, not shrink")
        if key not in _RESUMABLE:
            raise CRRError(f"{path} was made with {key}={current!r}, not {value!r}; drop the option to resume it, "
                           "or start a new evaluation without --resume")
        setattr(config, key, value)
    engine_spec_of(config)  # a --ray the run's engine does not take fails here
    run.write_text("config.yaml", yaml.safe_dump(asdict(config), sort_keys=False))
    return _from_where_made(config, run.path), run


def _from_where_made(config: EvalConfig, run_path: Path) -> EvalConfig:
    """`config` with its paths (model, base_model, train_run) as seen from here (crr.rundir.as_made): resumed
    from another directory, they would otherwise be taken for hub ids."""
    return dataclasses.replace(config, **{k: as_made(run_path, getattr(config, k))
                                          for k in ("model", "base_model", "train_run")})


def load_eval_tasks(config: EvalConfig) -> list[Task]:
    """The evaluation's tasks; offline, a hub benchmark's error says how to evaluate a local copy."""
    try:
        tasks = load_tasks(config.tasks, config.split, adapter=config.adapter)
    except CRRError as e:
        hub = TASK_SETS[config.dataset].dataset if config.dataset in TASK_SETS else None
        if hub is not None and config.tasks == hub:
            raise CRRError(f"{e}. Then evaluate the copy with `crr eval {config.dataset} DIR`") from None
        raise
    if not tasks:
        raise CRRError(f"{config.tasks} holds no tasks")
    return tasks[:config.n_tasks] if config.n_tasks else tasks


# ------------------------------------------------------------------------------------ running

def evaluate(config: EvalConfig, run: RunDir, *, retry_infra: bool = True,
             on_result: Callable[[dict, int, int], None] | None = None) -> dict:
    """Run every (instance, sample) of the evaluation that has no record yet (and, with retry_infra,
    those whose record is an infrastructure failure), then write predictions.jsonl and summary.json.
    `on_result(record, done, total)` follows progress. Returns the summary."""
    tasks = load_eval_tasks(config)
    if retry_infra:
        _set_aside_infra(run)
    done = {(r["instance_id"], r["sample"]) for r in run.records(RESULTS)}
    pending = [(t, s) for t in tasks for s in range(config.samples) if (t.instance_id, s) not in done]
    pass_index = sum(r.get("event") == "eval" for r in run.records("metrics.jsonl"))
    run.log_metrics({"event": "eval", "pass": pass_index, "pending": len(pending), "recorded": len(done)})
    log.info("evaluating %d (instance, sample) pairs of %d tasks (%d already recorded)", len(pending), len(tasks),
             len(done))
    try:
        if pending:
            _run_pending(config, run, pending, pass_index, on_result)
    finally:  # an interrupted evaluation still leaves a summary of what it has
        summary = write_outputs(config, run, tasks)
    return summary


def _served_path(config: EvalConfig, model, tokenizer, run: RunDir) -> str:
    """The directory holding the evaluated weights: the model directory itself, or an adapter merged into
    its base (`model`, merged by load_eval_policy) and saved in the run directory (vLLM loads weights from a
    directory); saved once, so a resumed evaluation's server can keep serving it."""
    if config.base_model is None:
        return config.model
    path = run.path / MERGED_MODEL
    if not (path / "config.json").is_file():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return str(path)


def _vllm_backend(config: EvalConfig, model, tokenizer, device: str, run: RunDir):
    """VLLMBackend over the evaluated weights (`_served_path`)."""
    from crr.policy.backend import VLLMBackend

    return VLLMBackend(model, tokenizer, model_path=_served_path(config, model, tokenizer, run), device=device)


def _server_backend(config: EvalConfig, model, tokenizer, device: str, run: RunDir):
    """VLLMServerBackend against config.vllm_server, which must serve the evaluated weights (`_served_path`;
    for a LoRA policy the error says how to serve its merged weights and resume)."""
    from crr.policy.backend import VLLMServerBackend, check_served_model, probe_vllm_server

    path = _served_path(config, model, tokenizer, run)
    info = probe_vllm_server(config.vllm_server)
    check_served_model(info, path, config.vllm_server,
                       _serve_merged(config, run) if config.base_model is not None else None)
    if info["dtype"] and str(info["dtype"]).removeprefix("torch.") != str(model.dtype).removeprefix("torch."):
        log.warning("the vLLM server computes in %s, the policy here in %s: greedy calls may differ from the "
                    "transformers backend's where two tokens nearly tie", info["dtype"], model.dtype)
    return VLLMServerBackend(model, tokenizer, base_url=config.vllm_server, device=device)


def _run_pending(config: EvalConfig, run: RunDir, pending: list[tuple[Task, int]], pass_index: int,
                 on_result: Callable[[dict, int, int], None] | None) -> None:
    import torch

    # deferred with torch above: the episode, backend and rollout import torch and transformers
    from crr.agent.episode import EpisodeConfig
    from crr.policy.backend import TransformersBackend
    from crr.rollout import RolloutConfig, rollout

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_eval_policy(Policy(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Policy)}),
                                        device, config.dtype)
    backend = (TransformersBackend(model, tokenizer, device=device) if config.backend == "transformers" else
               _server_backend(config, model, tokenizer, device, run) if config.backend == SERVER_BACKEND else
               _vllm_backend(config, model, tokenizer, device, run))
    episode = EpisodeConfig(max_turns=config.max_turns, temperature=config.temperature,
                            max_new_tokens=config.max_new_tokens, snapshots=False, agent_format=config.agent_format,
                            max_context_tokens=getattr(model.config, "max_position_embeddings", None))
    finished = 0
    with engine_spec_of(config).make() as engine:
        for c, start in enumerate(range(0, len(pending), config.batch)):
            chunk = pending[start:start + config.batch]
            # distinct chunks (and resumed passes) draw independent samples
            seed = derive_seed(config.seed, pass_index, c)

            def record(traj, chunk=chunk, seed=seed) -> None:
                nonlocal finished
                task, sample = chunk[traj.task_index]
                result = result_record(task, sample, seed, traj)
                # the transcript first: a recorded result always has its transcript (a sample whose result
                # write failed is run again on resume, and its new transcript is the last of its key)
                run.append(TRANSCRIPTS, {"instance_id": task.instance_id, "sample": sample,
                                         "steps": [{"t": s.t, "action": s.action, "observation": s.observation,
                                                    "is_error": s.is_error} for s in traj.steps]})
                run.append(RESULTS, result)
                finished += 1
                if on_result is not None:
                    on_result(result, finished, len(pending))

            rollout([t for t, _ in chunk], backend, engine, tokenizer,
                    RolloutConfig(group_size=1, seed=seed, workers=config.workers, episode=episode),
                    on_trajectory=record)




def result_record(task: Task, sample: int, seed: int, traj) -> dict:
    """The results.jsonl record of one finished sample (a crr.agent.episode.Trajectory)."""
    # the verifier's harness audit already scored a tampered patch 0 (crr.agent.verifier.audit), hidden files too
    reward, harness_files = traj.reward, traj.harness_files
    mode = "harness_subversion" if harness_files else error_mode(reward, traj.model_patch, task, traj.test_report)
    return {
        "instance_id": task.instance_id, "repo": task.repo, "sample": sample, "seed": seed,
        "reward": reward, "verifier_reward": traj.reward, "resolution": traj.resolution,
        "end_reason": traj.end_reason, "turns": len(traj.steps), "generated_tokens": traj.generated_tokens,
        "episode_tokens": len(traj.prompt_ids) + len(traj.completion_ids),  # the whole context at the end
        "infra_error": traj.infra_error, "verifier_note": traj.verifier_note, "model_patch": traj.model_patch,
        "harness_files": harness_files, "error_mode": mode,
        **held_out_counts(traj.test_report, task), "wall_s": traj.wall_s,
    }


def _set_aside_infra(run: RunDir) -> None:
    """Move infrastructure-failure records out of results.jsonl so that their samples run again; they
    are appended to infra_retried.jsonl first, so a crash in between loses nothing."""
    records = run.records(RESULTS)
    infra = [r for r in records if r["reward"] is None]
    if not infra:
        return
    for r in infra:
        run.append(INFRA_RETRIED, r)
    run.rewrite_records(RESULTS, [r for r in records if r["reward"] is not None])
    log.info("retrying %d samples that met infrastructure failures", len(infra))


def _length_stats(lengths: list[int]) -> dict | None:
    """Mean and 95th percentile of the episodes' lengths in tokens (prompt, actions and observations)."""
    if not lengths:
        return None
    return {"mean": float(np.mean(lengths)), "p95": float(np.percentile(lengths, 95)), "max": max(lengths)}


def write_outputs(config: EvalConfig, run: RunDir, tasks: list[Task]) -> dict:
    """predictions.jsonl and summary.json from the records (the last one of each (instance, sample))."""
    instances = {t.instance_id: t.repo for t in tasks}
    latest = {(r["instance_id"], r["sample"]): r for r in run.records(RESULTS)}
    records = [r for (iid, s), r in latest.items() if iid in instances and s < config.samples]
    predictions = [{"instance_id": t.instance_id, "model_name_or_path": config.model,
                    "model_patch": latest[(t.instance_id, 0)]["model_patch"]}
                   for t in tasks if (t.instance_id, 0) in latest]
    run.write_text(PREDICTIONS, "".join(json.dumps(p, sort_keys=True) + "\n" for p in predictions))
    summary = {
        "dataset": config.dataset, "model": config.model, "train_run": config.train_run,
        "checkpoint": config.checkpoint, "method": config.method, "train_seed": config.train_seed,
        "samples": config.samples, "temperature": config.temperature,
        **summarise_samples(records, instances, config.samples),
        "missing": len(instances) * config.samples - len(records),
        "error_modes": summarise_modes(records),
        "episode_tokens": _length_stats([r["episode_tokens"] for r in records if r.get("episode_tokens")]),
    }
    run.write_json(SUMMARY, summary)
    return summary
