"""`crr eval`: greedy and sampled pass@k, SWE-bench predictions, the error taxonomy.

crr.eval (numpy; torch and transformers when it loads the policy, datasets for hub sets) is imported inside
the commands, never here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from crr.cli.common import (ENGINE_DEFAULT_LOCAL_HELP, _resume_with, console, emit_json, engine_opt_option,
                            engine_option, engine_settings, err_console, json_option, long_command,
                            max_new_tokens_option, mode_option, out_option, policy_option, progress_bar,
                            ray_option, seed_option, temperature_option)


@long_command
def eval_command(
    dataset: str | None = typer.Argument(None, help="micro (the embedded micro-test set; the default), verified, "
                                         "live, rebench, gym, or tasks."),
    file: str | None = typer.Argument(None, help="For tasks: a task file (JSONL) or directory. For verified, live, "
                                      "rebench, gym: a local copy (save_to_disk directory or .parquet) instead of "
                                      "the Hugging Face hub."),
    run_dir: Path | None = typer.Option(None, "--run", help="A `crr train` run directory: evaluates its model/ "
                                        "(or --checkpoint); LoRA adapters are applied to their base model."),
    model: str | None = policy_option(),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="With --run: N for checkpoints/checkpoint-N, "
                                          "or a checkpoint directory."),
    samples: int | None = typer.Option(None, "--samples", help="n samples per instance (default 1: greedy pass@1)."),
    temperature: float | None = temperature_option(None, help="Default 0 (greedy) for one sample, 0.6 for several "
                                                   "(the paper's sampled evaluation)."),
    seed: int | None = seed_option(None, help="Drives every sampling seed (default 0)."),
    n_tasks: int | None = typer.Option(None, "--n-tasks", help="Evaluate the first N tasks (default: all)."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="H: the turn cap (default 50)."),
    max_new_tokens: int | None = max_new_tokens_option(None, help="Token budget of one tool call (default 512)."),
    split: str | None = typer.Option(None, "--split", help="Dataset split (default: the dataset's usual one)."),
    engine: str | None = engine_option(None, help=ENGINE_DEFAULT_LOCAL_HELP),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(),
    workers: int | None = typer.Option(None, "--workers", help="Concurrent tool executions (default 4; on a Ray "
                                       "engine, the cluster's sandbox slots)."),
    batch: int | None = typer.Option(None, "--batch", help="Episodes run together, one sandbox each (default 32)."),
    backend: str | None = typer.Option(None, "--backend", help="Generation: transformers (default), vllm "
                                       "(needs vLLM: scripts/setup-vllm.sh makes .venv-vllm) or vllm-server (a "
                                       "running vLLM server, TRL's server mode: --vllm-server)."),
    vllm_server: str | None = typer.Option(None, "--vllm-server", metavar="URL", help="With --backend vllm-server: "
                                           "the server's URL. It must serve the evaluated model directory with "
                                           "crr's grammar processor (README: Going past one machine)."),
    dtype: str | None = typer.Option(None, "--dtype", help="The weights' dtype: auto (as saved; a --run's: as it "
                                     "trained), float32 (on CPUs without AVX512-BF16, where bf16 is emulated) or "
                                     "bfloat16."),
    out: Path = out_option(Path("results/evals")),
    resume: Path | None = typer.Option(None, "--resume", help="An earlier `crr eval` run directory: run only the "
                                       "samples it lacks (and its infrastructure failures)."),
    retry_infra: bool = typer.Option(True, "--retry-infra/--no-retry-infra", help="On resume, run the samples "
                                     "that met infrastructure failures again."),
    as_json: bool = json_option("the summary"),
) -> None:
    """Evaluate a policy: greedy pass@1 with the 50-turn cap, or `--samples n` for sampled pass@1,
    pass@k (k = 1, 2, 4, 8; unbiased estimator), pass^k (all k drawn samples solve) and all-n, each with its
    95% Wilson interval; per-repository pass@1 and the error taxonomy
    of failed samples. Grades in crr's sandboxes with swebench's grading; writes results.jsonl,
    SWE-bench predictions.jsonl and summary.json to a run directory (resumable)."""
    from crr.eval.evaluate import evaluate, open_eval

    with err_console.status("resolving the policy (the default model is built on first use) and the tasks"):
        config, run = open_eval(dataset, file, model=model, run_dir=run_dir, checkpoint=checkpoint, out=out,
                                resume=resume, samples=samples, temperature=temperature, seed=seed,
                                n_tasks=n_tasks, max_turns=max_turns, max_new_tokens=max_new_tokens, split=split,
                                **engine_settings(engine, engine_opt, ray, mode), workers=workers, batch=batch,
                                backend=backend, vllm_server=vllm_server, dtype=dtype)
    _resume_with(f"crr eval --resume {shlex.quote(str(run.path))}")
    err_console.print(f"run directory: {run.path}", highlight=False)
    progress = progress_bar(f"eval {config.dataset}", "{task.fields[note]}")
    bar = progress.add_task(config.dataset, total=None, note="")
    passed = {"n": 0, "scored": 0}

    def on_result(record: dict, done: int, total: int) -> None:
        if record["reward"] is not None:
            passed["scored"] += 1
            passed["n"] += record["reward"] == 1.0
        progress.update(bar, completed=done, total=total, note=f"passed {passed['n']}/{passed['scored']}")

    with progress:
        summary = evaluate(config, run, retry_infra=retry_infra, on_result=on_result)
    if as_json:
        emit_json({**summary, "run_dir": str(run.path)})
        return
    for table in _eval_tables(summary):
        console.print(table)
    console.print(f"results: {run.path / 'results.jsonl'}; SWE-bench predictions: {run.path / 'predictions.jsonl'}",
                  highlight=False, soft_wrap=True)


def _eval_tables(summary: dict) -> list:
    from rich.table import Table

    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    ci = lambda c: "-" if c is None else f"[{c[0]:.1%}, {c[1]:.1%}]"  # noqa: E731
    n, t = summary["samples"], summary["temperature"]
    head = Table(title=f"crr eval: {summary['dataset']}, {summary['n_instances']} instances, {summary['model']}")
    for col, justify in (("metric", "left"), ("value", "right"), ("95% CI (Wilson, over instances)", "right")):
        head.add_column(col, justify=justify)
    head.add_row(f"pass@1 ({'greedy' if t == 0 else f'sampled, T={t:g}, n={n}'})", pct(summary["pass_at_1"]),
                 ci(summary["pass_at_1_ci"]))
    for k, v in summary["pass_at_k"].items():
        if k != "1":
            head.add_row(f"pass@{k}", pct(v), ci(summary["pass_at_k_ci"][k]))
    for k, v in summary["pass_hat_k"].items():
        if k != "1":   # pass^1 is pass@1
            head.add_row(f"pass^{k} (all {k} drawn solve)", pct(v), ci(summary["pass_hat_k_ci"][k]))
    if n > 1:
        head.add_row(f"all-{n}", pct(summary["all_n"]), ci(summary["all_n_ci"]))
    head.add_row("scored samples", str(summary["scored"]), "")
    head.add_row("infrastructure failures (excluded)", str(summary["infra_errors"]), "")
    if summary["missing"]:
        head.add_row("samples not run yet", str(summary["missing"]), "")
    repos = Table(title="per repository")
    for col, justify in (("repo", "left"), ("instances", "right"), ("pass@1", "right"), ("95% CI", "right")):
        repos.add_column(col, justify=justify)
    for repo, r in summary["per_repo"].items():
        repos.add_row(repo, str(r["instances"]), pct(r["pass_at_1"]), ci(r["pass_at_1_ci"]))
    modes = Table(title="error modes of failed samples")
    for col, justify in (("mode", "left"), ("count", "right"), ("share of failures", "right"),
                         ("rate (all scored)", "right")):
        modes.add_column(col, justify=justify)
    for mode, m in summary["error_modes"].items():
        modes.add_row(mode, str(m["count"]), pct(m["share"]), pct(m["rate"]))
    return [head, repos, modes]
