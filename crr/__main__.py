"""`python -m crr ...`: the same as the `crr` console script."""

from crr.cli import app

app(prog_name="crr")
