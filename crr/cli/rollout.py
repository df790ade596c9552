"""`crr rollout` (G trajectories per task, transcripts, the pass rate) and `crr rollout bench`.

torch and transformers are imported inside the commands (through crr.policy), never here.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import console, emit_json, err_console, friendly, long_command
from crr.errors import CRRError

rollout_app = typer.Typer(help="Roll out a policy: G trajectories per task in sandboxes, with transcripts "
                               "and the pass rate; `crr rollout bench` times throughput and forking.")


@rollout_app.callback(invoke_without_command=True)
@long_command
def rollout_command(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the shipped "
                                     "warm-started default)."),
    tasks: str = typer.Option("micro-test", "--tasks", help="Task file (JSONL), directory, micro set or dataset."),
    n: int = typer.Option(1, "--n", help="Tasks to roll out (the first N)."),
    group: int = typer.Option(8, "--group", help="G: trajectories per task."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay."),
    temperature: float = typer.Option(0.6, "--temperature", help="0.6 the paper's rollouts; 0 greedy."),
    seed: int = typer.Option(0, "--seed", help="Drives every sampling seed."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="H: the turn cap (default: the model's "
                                         "recorded H, else 50)."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Token budget of one tool call."),
    agent_format: str | None = typer.Option(None, "--agent-format", help="paper or compact (default: the "
                                            "format the model was trained with, else paper)."),
    max_value_chars: int | None = typer.Option(None, "--max-value-chars", help="Bound every string argument "
                                               "(complete calls from untrained models; slower masks)."),
    time_limit: float = typer.Option(3600.0, "--time-limit", help="Seconds per trajectory (wall clock)."),
    workers: int = typer.Option(4, "--workers", help="Concurrent tool executions."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where the run directory goes."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Run the policy on N tasks, G trajectories each; print each transcript (call, H_t, tool type, a
    short observation) and the pass rate. Trajectories go to trajectories.jsonl in a run directory."""
    if ctx.invoked_subcommand is not None:
        return
    import dataclasses

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from crr.agent.episode import EpisodeConfig
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import agent_record, default_policy_dir, load_policy
    from crr.replay import get_engine
    from crr.rollout import TRAJECTORIES_FILE, RolloutConfig, rollout
    from crr.rundir import RunDir
    from crr.tasks.loaders import load_tasks

    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    task_list = load_tasks(tasks)[:n]
    if model is None:
        with err_console.status("loading the default model (the random tiny one is built on first use)"):
            model = str(default_policy_dir())
    policy, tokenizer = load_policy(model)
    record = agent_record(model)
    # Nothing forks here, so no snapshots; the trainer keeps them.
    config = RolloutConfig(group=group, seed=seed, workers=workers, episode=EpisodeConfig(
        agent_format=agent_format or record.get("agent_format", "paper"),
        max_turns=max_turns or record.get("max_turns", 50), temperature=temperature, max_new_tokens=max_new_tokens, time_limit_s=time_limit,
        max_context_tokens=getattr(policy.config, "max_position_embeddings", None), snapshots=False))
    backend = TransformersBackend(policy, tokenizer, max_value_chars=max_value_chars)
    run = RunDir.create("rollout", f"n{n}-g{group}-seed{seed}", root=out, seeds={"rollout": seed},
                        config={"model": model, "tasks": tasks, "n": n, "engine": engine, "mode": mode,
                                "max_value_chars": max_value_chars, **dataclasses.asdict(config)})
    err_console.print(f"run directory: {run.path}", highlight=False)
    progress = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console)
    bar = progress.add_task("rollout", total=len(task_list) * group)
    fork_engine = get_engine(engine, **({"mode": mode} if mode else {}))
    try:
        with progress:
            result = rollout(task_list, backend, fork_engine, tokenizer, config, run=run,
                             on_trajectory=lambda _: progress.advance(bar))
    finally:
        fork_engine.close()
    summary = {**result.summary, "run_dir": str(run.path)}
    if as_json:  # token ids and log-probabilities are in trajectories.jsonl
        emit_json({"summary": summary, "trajectories": [
            {**{k: v for k, v in t.to_dict().items() if k not in ("steps", "messages", "prompt_ids")},
             "steps": [{k: getattr(s, k) for k in ("t", "action", "call", "parse_error", "observation", "is_error",
                                                    "entropy", "tool_type", "grammar_rejections", "truncated")}
                       for s in t.steps]} for t in result.trajectories]})
        return

    def reward(t) -> str:
        return f"[yellow]infra: {t.infra_error}[/]" if t.reward is None else f"R = {t.reward:g}"

    for t in result.trajectories:
        table = Table(title=f"{t.task_id} #{t.group}: {reward(t)}, {t.end_reason} after {len(t.steps)} turns",
                      title_justify="left")
        for col, justify in (("t", "right"), ("call", "left"), ("H_t", "right"), ("type", "right"),
                             ("observation", "left")):
            table.add_column(col, justify=justify, overflow="fold" if col == "call" else "ellipsis")
        for s in t.steps:
            obs = next((line for line in s.observation.splitlines() if line.strip()), "")[:70]
            table.add_row(str(s.t), Text(s.action[:100] + ("..." if len(s.action) > 100 else "")),
                          f"{s.entropy:.2f}", "-" if s.tool_type is None else f"{s.tool_type:g}",
                          Text(obs, style="red" if s.is_error else ""))
        console.print(table)
    rate = "n/a" if summary["pass_rate"] is None else f"{summary['pass_rate']:.1%}"
    console.print(f"pass rate [bold]{rate}[/] ({summary['passed']}/{summary['scored']} scored; "
                  f"{summary['infra_errors']} infra errors excluded); {summary['steps']} turns, "
                  f"{summary['generated_tokens']} generated tokens ({summary['generated_tokens_per_s'] or 0:.1f}/s), "
                  f"{summary['trajectories_per_min']:.2f} trajectories/min", highlight=False, soft_wrap=True)
    console.print(f"trajectories: {run.path / TRAJECTORIES_FILE}", highlight=False)


@rollout_app.command("bench")
@friendly
def rollout_bench_command(
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the tiny default)."),
    group: int = typer.Option(8, "--group", help="G: trajectories of the one micro task."),
    max_turns: int = typer.Option(4, "--max-turns", help="Turn cap of the throughput run."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    max_value_chars: int = typer.Option(16, "--max-value-chars", help="Bound every string argument to this many "
                                        "characters (the untrained default model rambles); 0: unbounded, as a "
                                        "trained policy runs."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay (fork bench)."),
    fork_steps: int = typer.Option(45, "--fork-steps", help="Length of the scripted trajectory forked."),
    repeats: int = typer.Option(5, "--repeats", help="Timed forks per index and strategy."),
    only: str | None = typer.Option(None, "--only", help="throughput or fork (default: both)."),
    threads: int | None = typer.Option(None, "--threads", help="torch intra-op threads (default: torch's)."),
    prefix_cache: str = typer.Option("on", "--prefix-cache", help="Throughput with prefix KV reuse across turns "
                                     "(on), without (off), or both in one run (both: prints the speed-up)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Rollout throughput (generated tokens/s, trajectories/min at G) and fork-by-index latency at t=5
    and t=40: restore of the per-step snapshot vs replay of the prefix verified by tree digest."""
    from rich.table import Table

    from crr.rollout_bench import fork_bench, throughput_bench

    if only not in (None, "throughput", "fork"):
        raise CRRError(f"--only takes throughput or fork, got {only!r}")
    if prefix_cache not in ("on", "off", "both"):
        raise CRRError(f"--prefix-cache takes on, off or both, got {prefix_cache!r}")
    result: dict = {}
    if only in (None, "fork"):
        with err_console.status(f"fork bench: a {fork_steps}-step scripted trajectory on the {engine} engine"):
            result["fork"] = fork_bench(engine, steps=fork_steps, repeats=repeats, **({"mode": mode} if mode else {}))
    if only in (None, "throughput"):
        for reuse in {"on": [True], "off": [False], "both": [False, True]}[prefix_cache]:
            with err_console.status(f"throughput bench: G={group}, {max_turns}-turn cap, prefix cache "
                                    f"{'on' if reuse else 'off'}"):
                result["throughput" if reuse else "throughput_no_prefix_cache"] = throughput_bench(
                    model, group=group, max_turns=max_turns, max_new_tokens=max_new_tokens,
                    max_value_chars=max_value_chars or None, engine=engine, threads=threads, prefix_cache=reuse)
    if as_json:
        emit_json(result)
        return
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
        console.print(f"throughput ({reuse}): G={r['group']}, {r['max_turns']}-turn cap, {r['steps']} turns, "
                      f"{r['threads']} torch thread(s): "
                      f"[bold]{r['generated_tokens_per_s']:.1f} generated tokens/s[/] ({r['generated_tokens']} in "
                      f"{r['generation_s']:.0f} s of generation), [bold]{r['trajectories_per_min']:.2f} "
                      f"trajectories/min[/] ({r['wall_s']:.0f} s wall)", highlight=False, soft_wrap=True)
    if "throughput" in result and "throughput_no_prefix_cache" in result:
        on, off = result["throughput"], result["throughput_no_prefix_cache"]
        console.print(f"prefix reuse speed-up: generation time x{off['generation_s'] / on['generation_s']:.2f}, "
                      f"trajectories/min x{on['trajectories_per_min'] / off['trajectories_per_min']:.2f}",
                      highlight=False)
