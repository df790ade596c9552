"""The SFT warm start: the exploring expert's trajectories, then TRL's SFTTrainer on them.

    data = build_sft_dataset(load_tasks("micro-train"), get_engine("local"), seed=0, tokenizer=tokenizer)
    sft(default_model_dir(), data, out_dir, SFTSettings(epochs=3))   # load_policy(out_dir) then works

Expert data. Each episode is planned by crr.agent.expert.explore_script and played through the same episode
driver the policy's rollouts use (crr.rollout.run_episode with crr.policy.scripted.ScriptedBackend: no
generation record); the verifier scores the final state and only episodes with reward 1 are kept (the
fraction kept is recorded). A row is the token stream RL builds for the same conversation
(crr.agent.conversation): the prompt with the paper's system prompt and turn cap, each observation as the
chat template's tool turn, and each action as ids the grammar-constrained sampler can emit (`action_ids`):
the tokenizer's own encoding, except where the tool-call grammar forces its canonical token for a piece of
structure. Plain chat-template tokenization would teach, for example, `"run` + `_shell`, while the grammar
forces `_` there (run_shell and run_tests part after it): every run_* call of the warm-started policy would
meet a grammar rejection and continue off its training distribution.

Training. The rows are pre-tokenized (`input_ids`) with an `assistant_masks` column (1 on action tokens,
end-of-turn included; 0 on the prompt and the observations), a format TRL's SFTTrainer takes as is: it
folds the mask into `labels`, so the loss is on the tool calls only. Tokenizing here rather than letting
TRL render `messages` keeps one definition of the layout (conversation.py) for SFT and RL alike, with the
sampler's action tokens; the `messages` and `tools` columns stay for auditing (their chat-template text is
the rows' text).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import datasets
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from crr.agent.episode import EpisodeConfig
from crr.agent.expert import ExpertConfig, call_json, explore_script
from crr.agent.prompt import DEFAULT_MAX_TURNS, agent_format
from crr.errors import CRRError, SandboxError
from crr.experiments import read_yaml
from crr.policy import check_model
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import (
    SFT_RECIPE_VERSION,  # noqa: F401  (re-exported)
    default_model_dir,
    default_sft_model_dir,
    load_policy,
    write_split_model,
)
from crr.policy.scripted import ScriptedBackend
from crr.rollout import run_episode
from crr.sandbox import engine_spec_of
from crr.sandbox.base import ForkEngine
from crr.sandbox.checkout import building
from crr.rundir import RunDir
from crr.seeds import check_seed
from crr.sft.curriculum import DEFAULT_LEVELS, LEVELS, curriculum_rows
from crr.sft.rows import action_parts, sft_row
from crr.sft.trainer import SFTSettings, quiet_hf, sft
from crr.tasks.loaders import MICRO_DEFAULT_N, MICRO_SETS, TASK_SETS, hub_dataset, load_micro, load_tasks
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

EXPERT_FILE = "expert.jsonl"
EXPERT_ROWS_FILE = "expert_rows.jsonl"   # the kept episodes' rows, as they finish (resume)


@dataclass
class ExpertDataSettings:
    episodes_per_task: int = 1           # expert episodes per task, each with its own seed
    max_turns: int = DEFAULT_MAX_TURNS   # H in the system prompt: the same cap the policy is evaluated with
    agent_format: str = "paper"          # crr.agent.prompt.FORMATS: how episodes are shown to the model
    max_tokens: int = 8192               # drop longer episodes (a row must fit the model's context)
    workers: int = 2                     # episodes played concurrently (their commands are processes)
    expert: ExpertConfig = field(default_factory=ExpertConfig)

    def __post_init__(self) -> None:
        if self.episodes_per_task < 1:
            raise CRRError(f"episodes_per_task must be at least 1, got {self.episodes_per_task}")
        if self.workers < 1:
            raise CRRError(f"workers must be at least 1, got {self.workers}")


# ----------------------------------------------------------------------------- expert data

def expert_episode(task: Task, engine: ForkEngine, grammar: ToolCallGrammar, seed: int,
                   settings: ExpertDataSettings) -> tuple[dict, dict]:
    """Plan and play one expert episode; returns (row, record): the SFT row (None if the sandbox failed)
    and what the run keeps."""
    try:
        with engine.start(task) as sandbox:  # scratch: the plan reads files and tries wrong fixes there
            plan = explore_script(task, sandbox, seed, settings.expert)
    except SandboxError as e:  # an infrastructure failure: labelled, never a failed expert episode
        return None, {"instance_id": task.instance_id, "seed": seed, "reward": None,
                      "end_reason": "infra_error", "infra_error": str(e), "steps": 0, "wrong_edit": None,
                      "tokens": 0, "action_tokens": 0, "calls": []}
    config = EpisodeConfig(max_turns=settings.max_turns, snapshots=False, agent_format=settings.agent_format)
    traj = run_episode(task, ScriptedBackend([call_json(c) for c in plan.calls]), engine, grammar.tokenizer, config)
    messages = traj.conversation(grammar.tokenizer).messages
    tools = agent_format(settings.agent_format).tools
    tokens = sft_row(grammar, messages, tools)
    ids, mask = tokens["input_ids"], tokens["assistant_masks"]
    record = {"instance_id": task.instance_id, "seed": seed, "reward": traj.reward,
              "end_reason": traj.end_reason, "infra_error": traj.infra_error, "steps": len(traj.steps),
              "wrong_edit": plan.wrong_edit,
              "tokens": len(ids), "action_tokens": sum(mask),
              "calls": [s.call["name"] if s.call else None for s in traj.steps]}
    row = {"instance_id": task.instance_id, "seed": seed, "messages": messages,
           "tools": json.dumps(tools), **tokens}
    return row, record


def build_sft_dataset(tasks: list[Task], engine: ForkEngine, seed: int, tokenizer: PreTrainedTokenizerBase,
                      settings: ExpertDataSettings | None = None, *, run: RunDir | None = None,
                      progress: Callable[[dict], None] | None = None) -> Dataset:
    """Expert conversations over `tasks` that the verifier scores 1 (in task, episode order).

    Episode k of task i uses expert seed `seed * 1000 + k`. Every episode is recorded in `run`'s
    expert.jsonl and `progress` (kept or not, with why), a kept one's row in expert_rows.jsonl first, so an
    interrupted run resumes with the episodes it finished (a record whose row is missing is played again;
    `progress` gets the finished ones' records first); the summary (kept fraction) goes to
    expert_summary.json and to the log."""
    settings = settings or ExpertDataSettings()
    if not tasks:
        raise CRRError("no tasks to build expert data from")
    jobs = [(task, seed * 1000 + k) for task in tasks for k in range(settings.episodes_per_task)]
    grammar = ToolCallGrammar(tokenizer)
    done: dict[tuple[str, int], tuple[dict | None, dict]] = {}
    if run is not None:
        saved = {(r["instance_id"], r["seed"]): r for r in run.records(EXPERT_ROWS_FILE)}
        for record in run.records(EXPERT_FILE):
            key = (record["instance_id"], record["seed"])
            if not record.get("kept") or key in saved:
                done[key] = saved.get(key), record
        if done:
            log.info("resuming with %d of %d expert episodes already played", len(done), len(jobs))
    lock = threading.Lock()

    def one(job: tuple[Task, int]) -> tuple[dict, dict]:
        row, record = expert_episode(job[0], engine, grammar, job[1], settings)
        record["kept"] = record["reward"] == 1.0 and record["tokens"] <= settings.max_tokens
        if run is not None:
            with lock:  # the row before its record: a record says its episode is whole
                if record["kept"]:
                    run.append(EXPERT_ROWS_FILE, row)
                run.append(EXPERT_FILE, record)
        if progress is not None:
            progress(record)
        return row, record

    todo = [job for job in jobs if (job[0].instance_id, job[1]) not in done]
    if progress is not None:  # a resumed run's progress starts from the episodes it finished
        for task, k in jobs:
            if (task.instance_id, k) in done:
                progress(done[(task.instance_id, k)][1])
    pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="crr-expert")
    try:
        for job, result in zip(todo, pool.map(one, todo), strict=True):
            done[(job[0].instance_id, job[1])] = result
    finally:  # on an interrupt, drop the episodes not started instead of waiting for all of them
        pool.shutdown(wait=True, cancel_futures=True)
    results = [done[(task.instance_id, k)] for task, k in jobs]
    rows = [row for row, record in results if record["kept"]]
    records = [record for _, record in results]
    summary = expert_summary(records)
    log.info("expert data: kept %d of %d episodes (%.0f%%); %d failed, %d infra errors, %d too long",
             summary["kept"], summary["episodes"], 100 * summary["kept_fraction"], summary["failed"],
             summary["infra_errors"], summary["too_long"])
    if run is not None:
        run.write_json("expert_summary.json", summary)
    if not rows:
        raise CRRError(f"the expert solved none of {len(jobs)} episodes (see {EXPERT_FILE} in the run "
                       "directory); check the tasks with `crr tasks show` and the engine with `crr doctor`")
    return Dataset.from_list(rows)


def expert_summary(records: list[dict]) -> dict:
    n = len(records)
    kept = sum(r["kept"] for r in records)
    return {"episodes": n, "kept": kept, "kept_fraction": kept / n if n else 0.0,
            "failed": sum(r["reward"] == 0.0 for r in records),
            "infra_errors": sum(r["reward"] is None for r in records),
            "too_long": sum(r["reward"] == 1.0 and not r["kept"] for r in records),
            "with_wrong_edit": sum(r["wrong_edit"] is not None for r in records),
            "mean_steps": sum(r["steps"] for r in records) / n if n else 0.0,
            "mean_tokens": sum(r["tokens"] for r in records) / n if n else 0.0,
            "action_token_fraction": (sum(r["action_tokens"] for r in records)
                                      / max(sum(r["tokens"] for r in records), 1))}


# ----------------------------------------------------------------------------- probing a policy on expert rows

def action_field_stats(model, tokenizer: PreTrainedTokenizerBase, dataset: Dataset) -> dict[str, dict]:
    """Where a policy departs from the expert: teacher-forced next-token loss and argmax accuracy over the
    action tokens of expert rows, per part of the call (`rows.action_parts`: the tool's name, then each
    argument's value by its key: path, start, end, replacement, command, test_filter, timeout). Positions
    where the grammar forces the token (braces, keys, quotes) are left out, as they are from H_t: the
    constrained sampler cannot get them wrong. A call is only right when every token of every part is."""
    grammar = ToolCallGrammar(tokenizer)
    totals: dict[str, list[float]] = {}
    for row in dataset:
        ids = row["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0].float().cpu()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        for k, part in enumerate(action_parts(grammar, ids, row["assistant_masks"])):
            if part is not None:
                entry = totals.setdefault(part, [0.0, 0, 0])
                entry[0] -= float(logp[k - 1, ids[k]])
                entry[1] += 1
                entry[2] += int(logp[k - 1].argmax()) == ids[k]
    return {part: {"tokens": n, "nll": nll / n, "accuracy": right / n}
            for part, (nll, n, right) in sorted(totals.items(), key=lambda item: -item[1][1])}


# ----------------------------------------------------------------------------- the whole warm start

# crr.policy.model.SFT_RECIPE_VERSION keys the cached warm-started default: bump it when SFTRecipe's defaults change
CURRICULUM_DIR = "curriculum_data"  # the synthetic rows
STAGE_MODEL_DIR = "stage"             # stage-N: the model after SFT stage N (all but the last)
DATA_DIR = "expert_data"  # in a run directory: the expert dataset (save_to_disk), reused on resume
CHECKPOINT_DIR = "checkpoints"
MODEL_DIR = "model"
BASE_MODEL_DIR = "base_model"  # the model with its tokenizer re-split (recipes with split_word_spaces)


@dataclass
class SFTRecipe:
    """Everything `crr sft` does, in one config (written to the run directory as config.yaml)."""
    tasks: str = "micro-train"         # anything crr.tasks.loaders.load_tasks takes
    n_tasks: int | None = 160          # the first N tasks (a micro set is generated that large if need be)
    seed: int = 0                      # the expert's episodes and the trainer
    engine: str = "local"              # local, docker, ray:<engine>, or pkg.module:Class (crr.sandbox.engines)
    engine_options: dict = field(default_factory=dict)  # the engine's options (docker: image, mem_limit, ...)
    ray: str | None = None             # a ray:... engine's cluster address, as ray.init takes it (None: auto)
    mode: str | None = None            # the Docker engine's mode: commit or overlay (an engine option)
    data: ExpertDataSettings = field(default_factory=ExpertDataSettings)
    train: SFTSettings = field(default_factory=SFTSettings)
    # Synthetic lookup-and-repair rows (crr.sft.curriculum) for the stages that use them.
    curriculum_rows: int = 0
    # Their levels, in order, an equal share each (crr.sft.curriculum: 0 views only the named function, 1 a
    # module of two functions, 2 up to three modules of up to four).
    curriculum_levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    # The seed of their draws (None: `seed`). A recipe that continues another's model names its own for fresh
    # rows while it reuses the expert episodes of the same `seed`.
    curriculum_seed: int | None = None
    # Re-split the model's tokenizer before anything else (crr.policy.model.split_word_spaces: names start
    # without a space-led token); the copy is the run's base_model/, and the data is tokenized with it.
    split_word_spaces: bool = False
    # SFT stages in order, each from the previous one's model: {data: expert | curriculum | both, optionally
    # levels: the curriculum rows of these levels only, and any SFTSettings field overriding `train`}, e.g. the
    # curriculum in level order, then both shuffled. Empty: one stage on the expert's rows with `train`.
    stages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.curriculum_rows < 0:
            raise CRRError(f"curriculum_rows must be >= 0, got {self.curriculum_rows}")
        if not self.curriculum_levels or set(self.curriculum_levels) - set(LEVELS):
            raise CRRError(f"curriculum_levels are some of {', '.join(map(str, LEVELS))}, got {self.curriculum_levels}")
        for stage in self.stages:
            if stage.get("data") not in ("expert", "curriculum", "both"):
                raise CRRError("bad SFT recipe: a stage's data is expert, curriculum or both, "
                               f"got {stage.get('data')!r}")
            if stage["data"] != "expert" and not self.curriculum_rows:
                raise CRRError("bad SFT recipe: a curriculum stage needs curriculum_rows > 0")
            if "levels" in stage and (stage["data"] == "expert" or not stage["levels"]
                                      or set(stage["levels"]) - set(self.curriculum_levels)):
                raise CRRError(f"bad SFT recipe: a stage's levels are some of curriculum_levels "
                               f"{self.curriculum_levels} in a curriculum or both stage, got {stage['levels']!r}")
            replace(self.train, **_settings_of(stage))  # unknown keys: TypeError
        if self.n_tasks is not None and self.n_tasks < 1:
            raise CRRError(f"n_tasks must be at least 1, got {self.n_tasks}")
        check_seed(self.seed)
        if self.curriculum_seed is not None:
            check_seed(self.curriculum_seed, "curriculum_seed")
        engine_spec_of(self)  # an option the engine does not take fails here

    @classmethod
    def from_dict(cls, d: dict) -> SFTRecipe:
        data = dict(d.get("data", {}))
        try:
            data["expert"] = ExpertConfig(**data.get("expert", {}))
            return cls(**{**d, "data": ExpertDataSettings(**data), "train": SFTSettings(**d.get("train", {}))})
        except TypeError as e:  # an unknown key
            raise CRRError(f"bad SFT recipe: {e}") from None

    @classmethod
    def from_yaml(cls, path: Path | str) -> SFTRecipe:
        path = Path(path)
        if not path.is_file():
            raise CRRError(f"no recipe file at {path}")
        d = read_yaml(path) or {}
        if not isinstance(d, dict):
            raise CRRError(f"{path} is not a recipe (a mapping of SFTRecipe's fields)")
        return cls.from_dict(d)


def _settings_of(stage: dict) -> dict:
    """A stage's SFTSettings overrides: every key but the rows it trains on."""
    return {k: v for k, v in stage.items() if k not in ("data", "levels")}


def start_sft(model: str, recipe: SFTRecipe, out: Path) -> RunDir:
    """A new `crr sft` run directory under `out`: the model to warm-start and the recipe in its config."""
    # a bad model fails here, not after a run directory and the expert's episodes
    check_model(model, f"--model {model}", adapter=False)
    if recipe.tasks not in TASK_SETS and not hub_dataset(recipe.tasks):
        load_tasks(recipe.tasks)  # so does a missing or malformed local task source (hub ids, named sets: later)
    return RunDir.create("sft", f"{Path(recipe.tasks).name}-seed{recipe.seed}", root=out, seeds={"sft": recipe.seed},
                         config={"model": model, "recipe": asdict(recipe)})


def resume_sft(path: Path) -> tuple[RunDir, str, SFTRecipe]:
    """An interrupted `crr sft` run directory, with the model and recipe it was started with (another command's
    run, or one whose config lacks them: a CRRError before it is locked or written)."""
    run = RunDir.open(path)
    if run.manifest.get("command") != "sft":
        raise CRRError(f"{path} is a `crr {run.manifest.get('command')}` run, not a warm start; --resume takes "
                       "a directory made by crr sft")
    config = run.config
    if not isinstance(config.get("model"), str) or not isinstance(config.get("recipe"), dict):
        raise CRRError(f"{run.path / 'config.yaml'} is corrupt (not a warm start's config: no model and recipe)")
    recipe = SFTRecipe.from_dict(config["recipe"])
    run.lock()
    return run, config["model"], recipe


Progress = Callable[[str, int, int, dict], None]  # (stage "expert" | "train", done, total, last record)


def warm_start(model_dir: Path | str, recipe: SFTRecipe, run: RunDir,
               progress: Progress | None = None, data_only: bool = False) -> Path:
    """Expert data (or the run's saved copy when resuming), then SFT; the model goes to run/model.
    With `data_only`, stop after the data and return its directory (train elsewhere with
    crr.sft.trainer, e.g. on a GPU node).

    Metrics go to run/metrics.jsonl (one record per logging step: the loss curve)."""
    if recipe.split_word_spaces:
        model_dir = write_split_model(model_dir, run.path / BASE_MODEL_DIR)
    data_dir = run.path / DATA_DIR
    if (data_dir / "dataset_info.json").is_file():
        dataset = Dataset.load_from_disk(str(data_dir))
        log.info("resuming with the %d expert conversations saved in %s", len(dataset), data_dir)
    else:
        if recipe.tasks in MICRO_SETS and (recipe.n_tasks or 0) > MICRO_DEFAULT_N[MICRO_SETS[recipe.tasks][0]]:
            tier, split = MICRO_SETS[recipe.tasks]
            tasks = load_micro(split, n=recipe.n_tasks, tier=tier)  # extends the default set
        else:
            tasks = load_tasks(recipe.tasks)[:recipe.n_tasks]
        with quiet_hf():
            _, tokenizer = load_policy(model_dir)
        engine = engine_spec_of(recipe).make()
        total = len(tasks) * recipe.data.episodes_per_task
        counter = iter(range(1, total + 1))
        try:
            on_episode = None if progress is None else lambda r: progress("expert", next(counter), total, r)
            dataset = build_sft_dataset(tasks, engine, recipe.seed, tokenizer, recipe.data, run=run,
                                        progress=on_episode)
        finally:
            engine.close()
        with quiet_hf():
            dataset.save_to_disk(str(data_dir))
    curriculum_dir = run.path / CURRICULUM_DIR
    if recipe.curriculum_rows and not (curriculum_dir / "dataset_info.json").is_file():
        with quiet_hf():
            _, tokenizer = load_policy(model_dir)
            draws = recipe.seed if recipe.curriculum_seed is None else recipe.curriculum_seed
            rows = curriculum_rows(ToolCallGrammar(tokenizer), recipe.curriculum_rows, draws,
                                   levels=tuple(recipe.curriculum_levels),
                                   max_turns=recipe.data.max_turns, p_def_edit=recipe.data.expert.p_def_edit)
            Dataset.from_list(rows).save_to_disk(str(curriculum_dir))
    if data_only:
        return data_dir

    def logger(stage: int) -> Callable[[dict], None]:
        def on_log(record: dict) -> None:
            run.log_metrics({"event": "sft", "stage": stage, **record})
            if progress is not None and "loss" in record:
                progress("train", record["step"], -1, record)
        return on_log

    on_step = None if progress is None else lambda done, total: progress("train", done, total, {})
    stages = recipe.stages or [{"data": "expert"}]

    def curriculum(levels: list[int] | None) -> Dataset:
        drawn = Dataset.load_from_disk(str(curriculum_dir))
        return drawn if levels is None else drawn.filter(lambda level: level in levels, input_columns="level")

    rows = {"expert": lambda _: dataset, "curriculum": curriculum,
            "both": lambda levels: datasets.concatenate_datasets([
                dataset.select_columns(["input_ids", "assistant_masks"]),
                curriculum(levels).select_columns(["input_ids", "assistant_masks"])])}
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        out = run.path / (MODEL_DIR if last else f"{STAGE_MODEL_DIR}-{i + 1}")
        checkpoints = run.path / (CHECKPOINT_DIR if last else f"{CHECKPOINT_DIR}-{i + 1}")
        if not (out / "config.json").is_file():  # a finished stage is kept on resume
            _log_up_to(run, i, checkpoints)
            settings = replace(recipe.train, seed=recipe.seed, **_settings_of(stage))
            sft(model_dir, rows[stage["data"]](stage.get("levels")), out, settings,
                agent=(recipe.data.agent_format, recipe.data.max_turns),
                checkpoints=checkpoints, resume=checkpoints.is_dir(), on_log=logger(i), progress=on_step)
        model_dir = out
    return model_dir


def _log_up_to(run: RunDir, stage: int, checkpoints: Path) -> None:
    """Cut the stage's records in metrics.jsonl back to its newest checkpoint (none: all of them), and its closing
    record (train_runtime ...), which the resumed training writes again: the steps a resume redoes are recorded
    once. (A record written before records named their stage counts as stage 0.)"""
    saved = [int(p.name.removeprefix("checkpoint-")) for p in checkpoints.glob("checkpoint-*")
             if p.name.removeprefix("checkpoint-").isdigit()]
    upto = max(saved, default=0)
    logged = run.records("metrics.jsonl")
    kept = [r for r in logged if not (r.get("event") == "sft" and r.get("stage", 0) == stage
                                      and (r.get("step", 0) > upto or "train_runtime" in r))]
    if len(kept) < len(logged):
        run.rewrite_records("metrics.jsonl", kept)


def sft_results(run: RunDir) -> tuple[dict | None, list[tuple[int, float]]]:
    """A run's expert data summary (None before the data is made) and its SFT loss at each logged step, as
    (optimizer step, loss) pairs (a stage's steps count from its start)."""
    path = run.path / "expert_summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else None
    return summary, [(r["step"], r["loss"]) for r in run.records("metrics.jsonl")
                     if r.get("event") == "sft" and "loss" in r]


def trainer_command(model: str, data_dir: Path, recipe: SFTRecipe) -> str:
    """The command that trains on expert data saved by `warm_start(..., data_only=True)` elsewhere (e.g. a GPU
    node) as the recipe would: crr.sft.trainer, OUT_DIR left to fill in."""
    settings = json.dumps(asdict(replace(recipe.train, seed=recipe.seed)))
    return (f"python -m crr.sft.trainer {model} OUT_DIR {data_dir} --agent "
            f"{recipe.data.agent_format}:{recipe.data.max_turns} --settings '{settings}'")


def install_if_default(model: str, recipe: SFTRecipe, model_out: Path) -> Path | None:
    """The tiny default warm-started by the default recipe becomes the cached warm-started default
    (`default_sft_model_dir`): where it is cached, or None for any other model or recipe."""
    if model != str(default_model_dir()) or recipe != SFTRecipe():
        return None
    return install_default(model_out, default_sft_model_dir(build=False))


def install_default(model: Path, target: Path) -> Path:
    """Copy a warm-started model into the cache as the default (atomic; a concurrent install wins)."""
    if (target / "config.json").is_file():
        return target
    with building(target, keep_theirs=lambda d: (d / "config.json").is_file()) as tmp:
        shutil.copytree(model, tmp)
    return target
