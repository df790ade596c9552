"""`python -m crr ...`: the same as the `crr` console script."""

from crr.cli import main

main()
