"""`crr view RUN_DIR...`: one self-contained HTML page of training runs and evaluations (crr.report.view)."""

from __future__ import annotations

from pathlib import Path

import typer

from crr.cli.common import console, friendly, out_option


@friendly
def view_command(
    runs: list[Path] = typer.Argument(..., help="Training or evaluation run directories, or folders holding them "
                                                "(searched recursively)."),
    out: Path | None = out_option(None, "The HTML file to write (default: view.html in the one run named, else "
                                        "crr-view.html here)."),
) -> None:
    """Write one HTML file (no server, no network) showing training runs (learning curves, every trajectory as a
    timeline coloured by advantage, the forks off their steps) and evaluations (the task-by-task table, each
    transcript, patch and error mode); print its path. Open it in a browser."""
    from crr.report.view import write_view

    path = write_view(runs, out)
    console.print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)", highlight=False)
