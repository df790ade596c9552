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
