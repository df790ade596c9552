"""The `crr` command line: thin over the library. Parses options, calls crr.*, renders with Rich.

Errors of the CRRError family print as one red line and exit 2; `crr --debug ...` shows tracebacks. So do
the usage errors Typer finds before a command runs (an unknown option or command, a value of the wrong type), in
`main`.

One module per command group (tasks, sandbox, filter, model, rollout, train, eval, report, experiment,
doctor, demo); what they share (consoles, `friendly`/`long_command`, library output, `emit_json`, the
options several commands take) is in crr.cli.common. This module builds `app`, and `main`, the console
script's entry point (`crr = "crr.cli:main"`) and `python -m crr`'s. Importing the command modules must stay
cheap, so that `crr --help` is fast: torch, trl, transformers and datasets are imported inside the command
functions that need them.
"""

from __future__ import annotations

import os
import sys

import typer

from crr.cli import demo, doctor
from crr.cli.common import (_library_output, _state, console, emit_json, err_console, friendly, long_command,
                            print_error, trust_task_code_option)
from crr.cli.credit import credit_app
from crr.cli.eval import eval_command
from crr.cli.experiment import experiment_app
from crr.cli.filter import filter_app
from crr.cli.model import _SFT_DEFAULTS, model_app, sft_command
from crr.cli.report import report_app
from crr.cli.rollout import rollout_app
from crr.cli.sandbox import fork_app, sandbox_app, tool_command
from crr.cli.tasks import tasks_app
from crr.cli.train import replay_app, train_command
from crr.cli.view import view_command
from crr.sandbox import TRUST_ENV

# Re-exported: what tests and callers used from the single-module crr/cli.py.
__all__ = ["_SFT_DEFAULTS", "_library_output", "app", "console", "emit_json", "err_console", "friendly",
           "long_command"]

app = typer.Typer(help="Counterfactual Rollout Replay: step-level credit for SWE agents from forkable "
                       "sandboxes.", no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for crr errors."),
          verbose: bool = typer.Option(False, "--verbose", help="Show what libraries say (warnings, log records, "
                                       "progress bars) here instead of in the run directory's crr.log."),
          trust_task_code: bool = trust_task_code_option()) -> None:
    _state["debug"], _state["verbose"] = debug, verbose
    if trust_task_code:  # the environment: Ray workers and the commands' subprocesses see it too
        os.environ[TRUST_ENV] = "1"


# `crr --help` lists commands in the order they are added here (single commands first, then groups).
app.command()(doctor.doctor)
app.command("tool")(tool_command)
app.command()(demo.demo)
app.command("sft")(sft_command)
app.command("train")(train_command)
app.command("eval")(eval_command)
app.command("view")(view_command)

app.add_typer(fork_app, name="fork")
app.add_typer(model_app, name="model")
app.add_typer(tasks_app, name="tasks")
app.add_typer(filter_app, name="filter-tasks")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(report_app, name="report")
app.add_typer(experiment_app, name="experiment")
app.add_typer(rollout_app, name="rollout")
app.add_typer(replay_app, name="replay")
app.add_typer(credit_app, name="credit")


def main() -> None:
    """`crr`: the app, with Typer's usage errors as crr's one line (exit 2) where Typer draws a box of 4-6 lines
    (the usage, a hint and the message in a panel). Run without standalone mode, Typer raises them instead of
    printing them; they derive from its public TyperException (typer._click's exceptions are private)."""
    try:
        code = app(prog_name="crr", standalone_mode=False)
    except typer.exceptions.TyperException as e:
        ctx, message = getattr(e, "ctx", None), e.format_message()
        if message:   # (a group run without a command has printed its help: nothing to add)
            see = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            print_error(f"{message}{see}")
        sys.exit(e.exit_code)
    except typer.Abort:
        err_console.print("Aborted!")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)   # an Exit's code (crr's commands return None)
