"""Sandboxes and fork engines: `crr fork bench`, `crr tool` (tool calls in a fresh sandbox of one task) and
`crr sandbox gc`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.text import Text

from crr.cli.common import (console, emit_json, engine_opt_option, engine_option, err_console, friendly,
                            json_option, mode_option, ray_option, tasks_option)
from crr.errors import CRRError

fork_app = typer.Typer(help="Fork engines: benchmark snapshot/restore latency.", no_args_is_help=True)


@fork_app.command("bench")
@friendly
def fork_bench_cmd(
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str = mode_option(help="local, ray:local: overlay|copy; docker, ray:docker: overlay|commit; or both."),
    files: int = typer.Option(5000, "--files", help="Files in the synthetic repository."),
    repeats: int = typer.Option(20, "--repeats", help="Timed forks."),
    as_json: bool = json_option(),
) -> None:
    """Time snapshot, restore and fork (snapshot + restore + `true` in the fork) on a synthetic repo."""
    from rich.table import Table

    from crr.bench.fork import fork_bench
    from crr.sandbox import parse_options

    with err_console.status(f"fork bench: {engine} engine, {files} files, {repeats} repeats"):
        result = fork_bench(engine, mode, n_files=files, repeats=repeats, ray=ray,
                            options=parse_options(engine_opt or []))
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"crr fork bench: {engine} engine, {files} files, {repeats} repeats (ms)")
    table.add_column("mode")
    for col in ("snapshot p50/p95", "restore p50/p95", "fork p50/p95", "exact"):
        table.add_column(col, justify="right")
    for r in result.get("modes", {"": result}).values():
        table.add_row(r["mode"], *(f"{r[f'{k}_ms_p50']:.1f} / {r[f'{k}_ms_p95']:.1f}"
                                   for k in ("snapshot", "restore", "fork")),
                      "[green]yes[/]" if r["exact"] else "[red]NO[/]")
    console.print(table)
    for key, ratio in result.items():
        if key.endswith("_fork_ratio"):
            console.print(f"{key}: {ratio:.1f}x")


# --- tool -------------------------------------------------------------------------------------
@friendly
def tool_command(
    tasks: str = tasks_option(...),
    instance: str = typer.Option(..., "--instance", help="instance_id of the task to open."),
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(),
    call: str | None = typer.Option(None, "--call", help='One tool call, e.g. \'{"name": "view_file", '
                                    '"arguments": {"path": "setup.py"}}\'.'),
    script: Path | None = typer.Option(None, "--script", exists=True, dir_okay=False,
                                       help="A JSON list or JSONL file of tool calls."),
    run_verifier: bool = typer.Option(False, "--verify", help="Run the held-out tests at the end."),
    as_json: bool = json_option("observations (and the verdict)"),
) -> None:
    """Run tool calls in a fresh sandbox of one task and show each observation."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from crr.agent.tools import play_calls, script_calls
    from crr.agent.verifier import verify
    from crr.sandbox import engine_spec, parse_options
    from crr.tasks.loaders import load_task

    if (call is None) == (script is None):
        raise CRRError("give exactly one of --call JSON or --script FILE")
    spec = engine_spec(engine, parse_options(engine_opt or []), ray=ray, mode=mode)
    try:
        texts = [call] if call is not None else script_calls(script.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CRRError(f"{script} is not UTF-8 text (byte {e.start + 1}); a script is a JSON list or JSONL "
                       "file of tool calls") from None
    if not texts and not run_verifier:
        raise CRRError(f"{script} holds no tool calls (with --verify, an empty script verifies the task untouched)")
    task = load_task(tasks, instance)
    records, result = [], None
    with spec.make() as fork_engine, fork_engine.start(task) as sb:
        for text, parsed, obs in play_calls(sb, texts):
            records.append({"call": text, "observation": obs.text, "is_error": obs.is_error, "terminal": obs.terminal})
            if not as_json:
                title = (f"{parsed.name} {json.dumps(parsed.arguments, ensure_ascii=False)}" if parsed
                         else "invalid tool call")
                style = "red" if obs.is_error else "green" if obs.terminal else "blue"
                console.print(Panel(Text(obs.text.rstrip("\n")), title=Text(title), title_align="left",
                                    border_style=style))
        if unplayed := len(texts) - len(records):
            err_console.print(f"{unplayed} call{'s' if unplayed > 1 else ''} after submit_patch not played: the "
                              "episode ended there", highlight=False)
        if run_verifier:
            result = verify(sb, task)
    if as_json:
        emit_json({"instance_id": instance, "steps": records,
                   "verifier": result.to_dict() if result else None})
    elif result is not None:
        verdict = (f"[red]infra error:[/] {escape(result.infra_error)}" if result.infra_error else
                   f"reward [bold]{result.reward:g}[/] ({result.resolution})"
                   + (f" — {escape(result.note)}" if result.note else ""))
        console.print(verdict, highlight=False)
        table = Table("held-out test", "status")
        for test_id, status in result.statuses.items():
            table.add_row(Text(test_id), Text(status, style="green" if status == "PASSED" else "red"))
        if result.statuses:
            console.print(table)


# --- sandbox ----------------------------------------------------------------------------------
sandbox_app = typer.Typer(help="Sandboxes: clean up what crashed runs left behind.", no_args_is_help=True)


@sandbox_app.command("gc")
@friendly
def sandbox_gc(
    all_: bool = typer.Option(False, "--all", help="Also remove the per-task image and /testbed caches."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
) -> None:
    """Remove the containers, snapshot images, mounts and directories of crashed crr runs (only
    crr's, only those whose owning process is gone)."""
    from crr.errors import SandboxError
    from crr.sandbox import docker as docker_engine
    from crr.sandbox.local import gc_leftovers

    verb = "would remove" if dry_run else "removed"
    try:
        removed = docker_engine.gc(all=all_, dry_run=dry_run)
        console.print(f"docker: {verb} {len(removed)}", highlight=False)
        for item in removed:
            console.print(f"  {item}", highlight=False)
    except SandboxError as e:
        console.print(f"docker: skipped ({e})", highlight=False)
    removed = gc_leftovers(dry_run=dry_run)
    console.print(f"local: {verb} {len(removed)}", highlight=False)
    for item in removed:
        console.print(f"  {item}", highlight=False)
