"""`crr rollout` (G trajectories per task, transcripts, the pass rate) and `crr rollout bench`.

torch and transformers are imported inside the commands (through crr.policy), never here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import (_resume_with, console, emit_json, engine_opt_option, engine_option, engine_settings,
                            err_console, friendly, json_option, long_command, max_new_tokens_option,
                            max_value_chars_option, mode_option, model_option, out_option, progress_bar,
                            ray_option, seed_option, tasks_option, temperature_option, threads_option)
from crr.errors import CRRError

rollout_app = typer.Typer(help="Roll out a policy: G trajectories per task in sandboxes, with transcripts "
                               "and the pass rate; `crr rollout bench` times throughput and forking.")


@rollout_app.callback(invoke_without_command=True)
@long_command
def rollout_command(
    ctx: typer.Context,
    model: str | None = model_option("the shipped warm-started default"),
    tasks: str = tasks_option("micro-test"),
    n: int = typer.Option(1, "--n", help="Tasks to roll out (the first N)."),
    group_size: int = typer.Option(8, "--group-size", "--group", help="G: trajectories per task."),
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(),
    temperature: float = temperature_option(),
    seed: int = seed_option(),
    max_turns: int | None = typer.Option(None, "--max-turns", help="H: the turn cap (default: the model's "
                                         "recorded H, else 50)."),
    max_new_tokens: int = max_new_tokens_option(512),
    agent_format: str | None = typer.Option(None, "--agent-format", help="paper or compact (default: the "
                                            "format the model was trained with, else paper)."),
    max_value_chars: int | None = max_value_chars_option(),
    time_limit: float = typer.Option(3600.0, "--time-limit", help="Seconds per trajectory (wall clock)."),
    workers: int | None = typer.Option(None, "--workers", help="Concurrent tool executions (default 4; on a Ray "
                                       "engine, the cluster's sandbox slots)."),
    out: Path = out_option(),
    resume: Path | None = typer.Option(None, "--resume", help="An interrupted `crr rollout` run directory: play "
                                       "the trajectories it lacks, with its settings (give no others)."),
    as_json: bool = json_option("the results"),
) -> None:
    """Run the policy on N tasks, G trajectories each; print each transcript (call, H_t, tool type, a
    short observation) and the pass rate. Trajectories go to trajectories.jsonl in a run directory."""
    if ctx.invoked_subcommand is not None:
        return

    from crr.policy.model import default_policy_dir
    from crr.rollout import TRAJECTORIES_FILE, resume_rollout, start_rollout

    if resume is not None:
        given = [p.opts[0] for p in ctx.command.params if p.name not in ("resume", "as_json")
                 and ctx.get_parameter_source(p.name).name not in ("DEFAULT", "DEFAULT_MAP")]
        if given:
            raise CRRError(f"a resumed rollout keeps the settings it was started with; drop {', '.join(given)}")
        job = resume_rollout(resume)
    else:
        if model is None:
            with err_console.status("loading the default model (the random tiny one is built on first use)"):
                model = str(default_policy_dir())
        job = start_rollout(model, tasks, n, out, group_size=group_size, seed=seed, workers=workers,
                            **engine_settings(engine, engine_opt, ray, mode), temperature=temperature,
                            max_turns=max_turns, max_new_tokens=max_new_tokens, agent_format=agent_format,
                            max_value_chars=max_value_chars, time_limit=time_limit)
    _resume_with(f"crr rollout --resume {shlex.quote(str(job.run.path))}")
    err_console.print(f"run directory: {job.run.path}", highlight=False)
    progress = progress_bar("rollout")
    bar = progress.add_task("rollout", total=job.total)
    with progress:
        result = job.execute(on_trajectory=lambda _: progress.advance(bar))
    summary = {**result.summary, "run_dir": str(job.run.path)}
    if as_json:
        emit_json(_rollout_json(summary, result.trajectories))
        return
    for t in result.trajectories:
        console.print(_transcript(t))
    rate = "n/a" if summary["pass_rate"] is None else f"{summary['pass_rate']:.1%}"
    console.print(f"pass rate [bold]{rate}[/] ({summary['passed']}/{summary['scored']} scored; "
                  f"{summary['infra_errors']} infra errors excluded); {summary['steps']} turns, "
                  f"{summary['generated_tokens']} generated tokens ({summary['generated_tokens_per_s'] or 0:.1f}/s), "
                  f"{summary['trajectories_per_min']:.2f} trajectories/min", highlight=False, soft_wrap=True)
    console.print(f"trajectories: {job.run.path / TRAJECTORIES_FILE}", highlight=False)


def _rollout_json(summary: dict, trajectories: list) -> dict:
    """The summary and each trajectory's steps (token ids and log-probabilities are in trajectories.jsonl)."""
    return {"summary": summary, "trajectories": [
        {**{k: v for k, v in t.to_dict().items() if k not in ("steps", "messages", "prompt_ids")},
         "steps": [{k: getattr(s, k) for k in ("t", "action", "call", "parse_error", "observation", "is_error",
                                                "entropy", "tool_type", "grammar_rejections", "truncated")}
                   for s in t.steps]} for t in trajectories]}


def _transcript(t):
    """One trajectory as a table: call, H_t, tool type and the first line of the observation per turn."""
    from rich.table import Table

    reward = f"[yellow]infra: {t.infra_error}[/]" if t.reward is None else f"R = {t.reward:g}"
    table = Table(title=f"{t.task_id} #{t.sibling}: {reward}, {t.end_reason} after {len(t.steps)} turns",
                  title_justify="left")
    for col, justify in (("t", "right"), ("call", "left"), ("H_t", "right"), ("type", "right"),
                         ("observation", "left")):
        table.add_column(col, justify=justify, overflow="fold" if col == "call" else "ellipsis")
    for s in t.steps:
        obs = next((line for line in s.observation.splitlines() if line.strip()), "")[:70]
        table.add_row(str(s.t), Text(s.action[:100] + ("..." if len(s.action) > 100 else "")),
                      f"{s.entropy:.2f}", "-" if s.tool_type is None else f"{s.tool_type:g}",
                      Text(obs, style="red" if s.is_error else ""))
    return table


@rollout_app.command("bench")
@friendly
def rollout_bench_command(
    model: str | None = model_option(),
    group_size: int = typer.Option(8, "--group-size", "--group", help="G: trajectories of the one micro task."),
    max_turns: int = typer.Option(4, "--max-turns", help="Turn cap of the throughput run."),
    max_new_tokens: int = max_new_tokens_option(96),
    max_value_chars: int = max_value_chars_option(16, help="Bound every string argument to this many characters "
                                                  "(the untrained default model rambles); 0: unbounded, as a "
                                                  "trained policy runs.", minimum=0),
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(help="Docker engine mode (docker, ray:docker): commit or overlay (fork bench)."),
    fork_steps: int = typer.Option(45, "--fork-steps", help="Length of the scripted trajectory forked."),
    repeats: int = typer.Option(5, "--repeats", help="Timed forks per index and strategy."),
    only: str | None = typer.Option(None, "--only", help="throughput or fork (default: both)."),
    threads: int | None = threads_option(),
    prefix_cache: str = typer.Option("on", "--prefix-cache", help="Throughput with prefix KV reuse across turns "
                                     "(on), without (off), or both in one run (both: prints the speed-up)."),
    as_json: bool = json_option(),
) -> None:
    """Rollout throughput (generated tokens/s, trajectories/min at G) and fork-by-index latency at t=5
    and t=40: restore of the per-step snapshot vs replay of the prefix verified by tree digest."""
    from crr.bench.rollout import fork_bench, throughput_bench, throughput_config
    from crr.policy import check_model
    from crr.sandbox import engine_spec, parse_options

    if only not in (None, "throughput", "fork"):
        raise CRRError(f"--only takes throughput or fork, got {only!r}")
    if prefix_cache not in ("on", "off", "both"):
        raise CRRError(f"--prefix-cache takes on, off or both, got {prefix_cache!r}")
    opts = engine_spec(engine, parse_options(engine_opt or []), ray=ray, mode=mode).options
    if only in (None, "throughput"):
        throughput_config(group_size, max_turns, max_new_tokens)  # a bad setting fails before the fork bench
        if model is not None:
            check_model(model, f"--model {model}", adapter=False)   # so does a bad model path
    result: dict = {}
    if only in (None, "fork"):
        with err_console.status(f"fork bench: a {fork_steps}-step scripted trajectory on the {engine} engine"):
            result["fork"] = fork_bench(engine, steps=fork_steps, repeats=repeats, **opts)
    if only in (None, "throughput"):
        for reuse in {"on": [True], "off": [False], "both": [False, True]}[prefix_cache]:
            with err_console.status(f"throughput bench: G={group_size}, {max_turns}-turn cap, prefix cache "
                                    f"{'on' if reuse else 'off'}"):
                result["throughput" if reuse else "throughput_no_prefix_cache"] = throughput_bench(
                    model, group_size=group_size, max_turns=max_turns, max_new_tokens=max_new_tokens,
                    max_value_chars=max_value_chars or None, engine=engine, threads=threads, prefix_cache=reuse,
                    engine_opts=opts)
    if as_json:
        emit_json(result)
        return
    _print_rollout_bench(result)


def _print_rollout_bench(result: dict) -> None:
    from rich.table import Table

    if "fork" in result:
        f = result["fork"]
        table = Table(title=f"fork by step index, {f['engine']} engine, {f['steps']}-step trajectory of {f['task']} "
                            f"(median of {f['repeats']}, ms)")
        for col in ("t", "restore snapshot", "+ first command", "replay + verify", "restore exact"):
            table.add_column(col, justify="right")
        for t, r in f["at"].items():
            table.add_row(str(t), f"{r['restore_ms_p50']:.1f}", f"{r['ready_ms_p50']:.1f}", f"{r['replay_ms_p50']:.0f}",
                          "[green]yes[/]" if r["restore_exact"] else "[red]NO[/]")
        console.print(table)
        console.print(f"per-step recording cost: snapshot {f['snapshot_ms_p50']:.1f} ms, tree digest "
                      f"{f['digest_ms_p50']:.0f} ms", highlight=False)
    for key in ("throughput_no_prefix_cache", "throughput"):
        if key not in result:
            continue
        r = result[key]
        reuse = (f"prefix cache on: {r['prompt_tokens_reused']} prompt tokens reused, {r['prompt_tokens_prefilled']} "
                 "encoded" if r["prefix_cache"] else "prefix cache off")
        console.print(f"throughput ({reuse}): G={r['group_size']}, {r['max_turns']}-turn cap, {r['steps']} turns, "
                      f"{r['threads']} torch thread(s): "
                      f"[bold]{r['generated_tokens_per_s']:.1f} generated tokens/s[/] ({r['generated_tokens']} in "
                      f"{r['generation_s']:.0f} s of generation), [bold]{r['trajectories_per_min']:.2f} "
                      f"trajectories/min[/] ({r['wall_s']:.0f} s wall)", highlight=False, soft_wrap=True)
    if "throughput" in result and "throughput_no_prefix_cache" in result:
        on, off = result["throughput"], result["throughput_no_prefix_cache"]
        console.print(f"prefix reuse speed-up: generation time x{off['generation_s'] / on['generation_s']:.2f}, "
                      f"trajectories/min x{on['trajectories_per_min'] / off['trajectories_per_min']:.2f}",
                      highlight=False)
