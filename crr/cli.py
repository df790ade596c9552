"""The `crr` command line: thin over the library. Parses options, calls crr.*, renders with Rich.

Errors of the CRRError family print as one red line and exit 2; `crr --debug ...` shows tracebacks.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Callable

import typer
from rich.console import Console

from crr.errors import CRRError

app = typer.Typer(help="Counterfactual Rollout Replay: step-level credit for SWE agents from forkable "
                       "sandboxes.", no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for crr errors.")) -> None:
    _state["debug"] = debug


def friendly(fn: Callable) -> Callable:
    """Turn a CRRError into a one-line message and exit code 2 (a traceback with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CRRError as e:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {e}")
            raise typer.Exit(2) from None

    return wrapper


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# Commands are added below, one section per area (tasks, sandbox/fork, tool, doctor, demo).
# ---------------------------------------------------------------------------------------------


# --- doctor -----------------------------------------------------------------------------------
@app.command()
@friendly
def doctor(as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check Python, torch, TRL, swebench, the Docker daemon, the base image, overlayfs, network
    namespaces and free disk; print what is missing and the command that fixes it."""
    from rich.table import Table

    from crr.doctor import run_checks

    checks = run_checks()
    if as_json:
        emit_json([c.__dict__ for c in checks])
    else:
        table = Table(title="crr doctor")
        for col in ("check", "status", "detail", "fix"):
            table.add_column(col)
        for c in checks:
            status = "[green]ok[/]" if c.ok else ("[red]missing[/]" if c.required else "[yellow]missing[/]")
            table.add_row(c.name, status, c.detail, "" if c.ok else c.fix)
        console.print(table)
    if not all(c.ok for c in checks if c.required):
        raise typer.Exit(1)
