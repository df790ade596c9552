"""Tasks: the row (crr.tasks.schema), loaders, the generated micro/nano sets and synthesised tasks.

Importing the package registers crr's task sources and their resolver with the sandbox layer (crr.tasks.sources)."""

from crr.tasks import sources  # noqa: F401  (registers `repo_src` and `sdist`)
