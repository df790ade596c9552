"""`crr doctor`: what this machine lacks, and the command that fixes it."""

from __future__ import annotations

import typer

from crr.cli.common import console, emit_json, friendly, json_option


@friendly
def doctor(as_json: bool = json_option("the checks")) -> None:
    """Check Python, torch, native bf16 arithmetic, TRL, swebench, the Docker daemon, the base image, overlayfs,
    network namespaces and free disk; print what is missing and the command that fixes it."""
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
