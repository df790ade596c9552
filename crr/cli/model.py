"""The policy model: `crr model init|generate|bench|probe`, and `crr sft` (the warm start).

torch and transformers are imported inside the commands (through crr.policy), never here: `crr --help`
stays fast.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import (ENGINES_HELP, _resume_with, console, emit_json, engine_opt_option, engine_option,
                            engine_settings, err_console, friendly, json_option, long_command,
                            max_new_tokens_option, max_value_chars_option, model_option, out_option,
                            policy_option, progress_bar, ray_option, seed_option, tasks_option,
                            temperature_option, threads_option)
from crr.errors import CRRError

model_app = typer.Typer(help="The policy model: build the tiny default, sample tool calls from a model.",
                        no_args_is_help=True)
_EXPERT_ENGINE = f"Fork engine for the expert's episodes: {ENGINES_HELP}."
MAX_GENERATE = 64  # `crr model generate --n`: its samples are one batch, whose memory grows with it


@model_app.command("init")
@friendly
def model_init(
    out: Path = out_option(..., "New directory for the model and tokenizer."),
    size: str = typer.Option("tiny", "--size", help="tiny (~4.4M parameters) or small (~13.8M)."),
    seed: int = seed_option(help="Seed of the random initial weights."),
) -> None:
    """Build the embedded default policy: a random Qwen3-architecture model and a byte-level BPE
    tokenizer trained offline, with a chat template TRL recognises for tool calling."""
    from crr.policy.model import CHAT_TEMPLATE, init_tiny_model, load_policy, param_count

    with err_console.status(f"training the tokenizer and building a {size} model"):
        path = init_tiny_model(out, seed=seed, size=size)
    model, tokenizer = load_policy(path)
    console.print(f"{size} Qwen3 model: [bold]{param_count(model):,}[/] parameters, vocab "
                  f"[bold]{len(tokenizer):,}[/], chat template {CHAT_TEMPLATE} (TRL) -> {path}", highlight=False)


@model_app.command("generate")
@friendly
def model_generate(
    model: str | None = model_option(),
    prompt: str = typer.Option(..., "--prompt", help="The user message (after the paper's system prompt)."),
    temperature: float = temperature_option(),
    n: int = typer.Option(4, "--n", help=f"Samples (one batch, at most {MAX_GENERATE})."),
    seed: int = seed_option(),
    max_new_tokens: int = max_new_tokens_option(128),
    max_value_chars: int | None = max_value_chars_option(),
    as_json: bool = json_option("the samples"),
) -> None:
    """Sample grammar-constrained tool calls and show each with its step entropy H_t and grammar
    rejections."""
    import dataclasses

    from rich.table import Table

    from crr.agent.prompt import SYSTEM_PROMPT
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import default_model_dir, load_policy

    if not 1 <= n <= MAX_GENERATE:
        raise CRRError(f"--n must be between 1 and {MAX_GENERATE}, got {n}")
    if model is None:
        with err_console.status("loading the default tiny model (built on first use)"):
            model = str(default_model_dir())
    backend = TransformersBackend(*load_policy(model), max_value_chars=max_value_chars)
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    start = time.perf_counter()
    samples = backend.generate([conversation] * n, temperature=temperature, seed=seed,
                               max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - start
    if as_json:
        emit_json([{**dataclasses.asdict(s), "rejection_rate": s.rejection_rate} for s in samples])
        return
    table = Table(title=f"{n} tool calls from {model} (T={temperature:g}, seed {seed})")
    for col, justify in (("#", "right"), ("tool call", "left"), ("tokens", "right"), ("H_t", "right"),
                         ("rejected", "right"), ("complete", "left")):
        table.add_column(col, justify=justify)
    for i, s in enumerate(samples):
        table.add_row(str(i), Text(s.text), str(len(s.action_ids)), f"{s.entropy:.3f}",
                      f"{s.grammar_rejections}/{len(s.action_ids)}",
                      "[red]truncated[/]" if s.truncated else "[green]yes[/]")
    console.print(table)
    tokens = sum(len(s.action_ids) for s in samples)
    rejected = sum(s.grammar_rejections for s in samples)
    console.print(f"grammar rejection rate {rejected / max(tokens, 1):.1%} ({rejected}/{tokens} tokens); "
                  f"{tokens / elapsed:.0f} tokens/s", highlight=False)


@model_app.command("bench")
@friendly
def model_bench(
    model: str | None = model_option(),
    batch: int = typer.Option(8, "--batch", help="Calls sampled together (G)."),
    max_new_tokens: int = max_new_tokens_option(64),
    temperature: float = temperature_option(),
    repeats: int = typer.Option(3, "--repeats", help="Timed batches."),
    max_value_chars: int | None = max_value_chars_option(),
    threads: int | None = threads_option(),
    as_json: bool = json_option(),
) -> None:
    """Time grammar-constrained generation on the paper's prompt: tokens/s and grammar rejection rate."""
    from crr.bench.model import generation_bench
    from crr.policy.model import default_model_dir

    if batch < 1 or repeats < 1:
        raise CRRError("--batch and --repeats must be at least 1")
    with err_console.status("generation bench"):
        result = generation_bench(model or str(default_model_dir()), batch=batch, max_new_tokens=max_new_tokens,
                                  temperature=temperature, repeats=repeats, max_value_chars=max_value_chars,
                                  threads=threads)
    if as_json:
        emit_json(result)
        return
    console.print(f"{result['model']}: batch {batch}, prompt {result['prompt_tokens']} tokens, T={temperature:g}, "
                  f"{result['threads']} thread(s): [bold]{result['tokens_per_s']:.0f} tokens/s[/] "
                  f"({result['generated_tokens']} tokens in {result['seconds']:.1f} s); grammar rejection rate "
                  f"{result['grammar_rejection_rate']:.1%}; truncated {result['truncated_rate']:.0%}; "
                  f"mean H_t {result['mean_step_entropy']:.2f}", highlight=False)


@model_app.command("sft-bench")
@friendly
def model_sft_bench(
    model: str | None = model_option(),
    batch: int = typer.Option(8, "--batch", help="Rows per optimizer step."),
    steps: int = typer.Option(6, "--steps", help="Timed optimizer steps per loss."),
    level: int = typer.Option(1, "--level", help="Curriculum level of the rows (0-4; level 1 rows are ~590 tokens, "
                              "level 4 ~1,470)."),
    bf16: bool = typer.Option(True, "--bf16/--fp32", help="bf16 autocast, as the CPU recipes train."),
    threads: int | None = threads_option(),
    as_json: bool = json_option(),
) -> None:
    """Time SFT steps: TRL's fused LM head against crr's action-token loss on the same batches."""
    from crr.bench.model import sft_step_bench
    from crr.policy import check_model
    from crr.policy.model import default_model_dir
    from crr.sft.curriculum import LEVELS

    if batch < 1 or steps < 1 or level not in LEVELS:
        raise CRRError(f"--batch and --steps must be at least 1 and --level one of {LEVELS}")
    if model is not None:
        check_model(model, f"--model {model}", adapter=False)
    with err_console.status("SFT step bench"):
        result = sft_step_bench(model or str(default_model_dir()), batch=batch, steps=steps, level=level,
                                bf16=bf16, threads=threads)
    if as_json:
        emit_json(result)
        return
    console.print(f"{model or 'the default model'}: {steps} steps of {batch} level-{level} rows "
                  f"({result['tokens']} tokens, {result['action_tokens']} with the loss), "
                  f"{'bf16' if bf16 else 'fp32'}, {result['threads']} "
                  f"thread(s): TRL's fused LM head {result['trl_fused_head_tokens_per_s']:.0f} tokens/s, action-token "
                  f"loss [bold]{result['action_tokens_tokens_per_s']:.0f} tokens/s[/] "
                  f"({result['speedup']:.2f}x); in batches of about one length (group_by_length) "
                  f"[bold]{result['grouped_tokens_per_s']:.0f} tokens/s[/] ({result['grouped_speedup']:.2f}x; "
                  f"padded tokens per token {result['random_padded_per_token']:.2f} -> "
                  f"{result['grouped_padded_per_token']:.2f})", highlight=False)


# The default recipe, crr.sft.warm_start.SFTRecipe() (tests/test_sft.py keeps them equal; `crr model probe`'s expert
# explores as the recipe's does); spelled out here so that the CLI starts without importing torch.
_SFT_DEFAULTS = {"tasks": "micro-train", "n_tasks": 160, "episodes": 1, "error_rate": 0.3, "epochs": 2.0,
                 "lr": 1e-3, "bf16": False, "decoy_views": 2}


@model_app.command("probe")
@friendly
def model_probe(
    model: str | None = policy_option(),
    tasks: str = tasks_option("micro-test"),
    n_tasks: int = typer.Option(16, "--n-tasks", help="Expert episodes on the first N tasks."),
    seed: int = seed_option(help="The expert's seed."),
    error_rate: float = typer.Option(_SFT_DEFAULTS["error_rate"], "--error-rate",
                                     help="Chance the expert makes a wrong edit first (0: every edit is the fix, "
                                     "so the figures measure copying, not guessing)."),
    decoy_views: int = typer.Option(_SFT_DEFAULTS["decoy_views"], "--decoy-views",
                                    help="At most this many look-alike or unrelated files viewed while "
                                    "localising (0: none)."),
    engine: str = engine_option(help=_EXPERT_ENGINE),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    as_json: bool = json_option(),
) -> None:
    """Where a policy departs from the exploring expert: teacher-forced loss and argmax accuracy of its
    action tokens on the expert's solved episodes, per part of the call (the tool, then each argument:
    path, line numbers, replacement, command, test filter); grammar-forced structure left out. A call is
    right only when every token of it is, so a part far below 100% caps the pass rate. The expert's
    detours (wrong edits, decoy views) are random draws no policy can predict: `--error-rate 0
    --decoy-views 0` leaves them out."""
    from rich.table import Table

    from crr.agent.expert import ExpertConfig
    from crr.eval.evaluate import load_eval_policy, resolve_policy
    from crr.policy.model import agent_record
    from crr.sandbox import engine_spec, parse_options
    from crr.sft.warm_start import ExpertDataSettings, action_field_stats, build_sft_dataset
    from crr.tasks.loaders import load_tasks

    if n_tasks < 1:
        raise CRRError(f"--n-tasks must be at least 1, got {n_tasks}")
    expert = ExpertConfig(error_rate=error_rate, max_decoy_views=decoy_views)  # bad values: one line, exit 2
    spec = engine_spec(engine, parse_options(engine_opt or []), ray=ray)
    policy = resolve_policy(model)
    policy_model, tokenizer = load_eval_policy(policy)
    task_list = load_tasks(tasks)[:n_tasks]
    record = agent_record(policy.model, policy.base_model)  # the episodes as this model was trained to see them
    settings = ExpertDataSettings(**{k: record[k] for k in ("agent_format", "max_turns") if k in record},
                                  expert=expert)
    with err_console.status(f"expert episodes on {len(task_list)} tasks"), spec.make() as fork_engine:
        rows = build_sft_dataset(task_list, fork_engine, seed, tokenizer, settings)
    with err_console.status(f"scoring {len(rows)} expert episodes"):
        stats = action_field_stats(policy_model, tokenizer, rows)
    result = {"model": policy.model, "tasks": tasks, "episodes": len(rows), "error_rate": error_rate,
              "decoy_views": decoy_views, "parts": stats}
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"{policy.model} on the expert's {len(rows)} solved episodes of {tasks} "
                        "(semantic action tokens)")
    for col in ("part", "tokens", "loss (nats)", "argmax accuracy"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for part, r in stats.items():
        table.add_row(part, str(r["tokens"]), f"{r['nll']:.2f}", f"{r['accuracy']:.1%}")
    console.print(table)


# --- sft (the warm start: exploring-expert trajectories, TRL's SFTTrainer) ---------------------


@long_command
def sft_command(
    model: str | None = model_option("the tiny default, built on first use; the result then becomes the cached "
                                     "warm-started default when the recipe is the default one",
                                     what="Model directory or hub id to warm-start"),
    tasks: str = tasks_option(_SFT_DEFAULTS["tasks"]),
    n_tasks: int | None = typer.Option(_SFT_DEFAULTS["n_tasks"], "--n-tasks",
                                       help="Use the first N tasks (micro-train is generated "
                                            "that large if N exceeds its default 32)."),
    episodes: int = typer.Option(_SFT_DEFAULTS["episodes"], "--episodes", help="Expert episodes per task."),
    error_rate: float = typer.Option(_SFT_DEFAULTS["error_rate"], "--error-rate",
                                     help="Chance the expert makes a wrong edit first."),
    epochs: float = typer.Option(_SFT_DEFAULTS["epochs"], "--epochs", help="SFT epochs."),
    lr: float = typer.Option(_SFT_DEFAULTS["lr"], "--lr", help="Peak learning rate (cosine schedule)."),
    bf16: bool = typer.Option(_SFT_DEFAULTS["bf16"], "--bf16/--fp32", help="bf16 autocast (faster on CPUs with "
                              "AVX512-BF16 and on GPUs; deterministic, but not bit-equal to fp32)."),
    seed: int = seed_option(help="Drives the expert's episodes and the trainer."),
    engine: str = engine_option(help=_EXPERT_ENGINE),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    out: Path = out_option(),
    resume: Path | None = typer.Option(None, "--resume", help="Continue an interrupted `crr sft` run directory "
                                       "(its config, expert data and latest checkpoint)."),
    recipe_file: Path | None = typer.Option(None, "--recipe", help="A recipe YAML (crr.sft.warm_start.SFTRecipe's "
                                            "fields, e.g. experiments/sft-nano.yaml, the shipped default's); "
                                            "replaces the recipe options above."),
    data_only: bool = typer.Option(False, "--data-only", help="Stop after the expert data; prints how to train "
                                   "on it elsewhere (python -m crr.sft.trainer, e.g. on a GPU node)."),
) -> None:
    """Warm-start a policy with supervised fine-tuning on scripted expert trajectories: the expert explores
    (views decoys, reproduces the issue, sometimes errs and corrects itself), every episode is played in a
    real sandbox and kept only if the verifier gives it reward 1; TRL's SFTTrainer then trains on the tool
    calls (observations masked). Writes a run directory with the config, expert.jsonl, the loss curve in
    metrics.jsonl and the model in model/."""
    from dataclasses import replace

    from crr.agent.expert import ExpertConfig
    from crr.policy.model import default_model_dir
    from crr.sft.warm_start import (ExpertDataSettings, SFTRecipe, SFTSettings, install_if_default,
                                    resume_sft, sft_results, start_sft, trainer_command, warm_start)

    if resume is not None:
        run, model, recipe = resume_sft(resume)
        if ray is not None or engine_opt:  # where the expert's sandboxes run, not what the recipe is: a resume
            recipe = replace(recipe, **engine_settings(None, engine_opt, ray))  # may move them
    else:
        recipe = SFTRecipe.from_yaml(recipe_file) if recipe_file is not None else SFTRecipe(
            tasks=tasks, n_tasks=n_tasks, seed=seed, engine=engine,
            data=ExpertDataSettings(episodes_per_task=episodes, expert=ExpertConfig(error_rate=error_rate)),
            train=SFTSettings(epochs=epochs, learning_rate=lr, bf16=bf16))
        if ray is not None or engine_opt:  # also on a --recipe file's engine
            recipe = replace(recipe, **engine_settings(None, engine_opt, ray))
        if model is None:
            with err_console.status("loading the default tiny model (built on first use)"):
                model = str(default_model_dir())
        run = start_sft(model, recipe, out)
    _resume_with(f"crr sft --resume {shlex.quote(str(run.path))}")
    err_console.print(f"run directory: {run.path}", highlight=False)
    progress, report = _sft_progress(train=not data_only)
    with progress:
        model_out = warm_start(model, recipe, run, report, data_only=data_only)
    summary, losses = sft_results(run)
    if summary:
        console.print(f"expert: kept [bold]{summary['kept']}/{summary['episodes']}[/] episodes "
                      f"({summary['kept_fraction']:.0%} with reward 1), {summary['with_wrong_edit']} with a corrected "
                      f"wrong edit, {summary['mean_steps']:.1f} steps and {summary['mean_tokens']:.0f} tokens "
                      "on average",
                      highlight=False)
    if data_only:
        console.print(f"expert data: {model_out}\ntrain on it with: {trainer_command(model, model_out, recipe)}",
                      highlight=False, soft_wrap=True)
        return
    if losses:
        (first_step, first), (last_step, last) = losses[0], losses[-1]
        console.print(f"SFT: loss {first:.3f} (step {first_step}) -> [bold]{last:.3f}[/] (step {last_step}), "
                      f"{len(losses)} logged steps", highlight=False)
    console.print(f"model: {model_out}", highlight=False)
    if (target := install_if_default(model, recipe, model_out)) is not None:
        console.print(f"cached as the warm-started default: {target}", highlight=False)


def _sft_progress(train: bool = True):
    """A Rich progress bar (expert episodes, then SFT steps unless not `train`) and the `warm_start` progress
    callback that drives it."""
    progress = progress_bar("{task.description}", "{task.fields[note]}")
    bars = {"expert": progress.add_task("expert episodes", total=None, note="", visible=False),
            "train": progress.add_task("SFT steps", total=None, note="", start=False, visible=train)}
    kept = {"n": 0}

    def report(stage: str, done: int, total: int, record: dict) -> None:
        if stage == "expert":
            kept["n"] += record["kept"]
            progress.update(bars["expert"], completed=done, total=total, note=f"kept {kept['n']}", visible=True)
            return
        progress.start_task(bars["train"])  # no-op once started: its clock counts training only
        if total > 0:
            progress.update(bars["train"], completed=done, total=total)
        else:
            progress.update(bars["train"], note=f"loss {record['loss']:.3f}")

    return progress, report
