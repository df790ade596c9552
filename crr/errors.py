"""One error family for everything a user can act on.

The CLI prints a `CRRError` without a traceback and exits 2 (`--debug` shows the traceback); any
other exception is a bug in crr.
"""


class CRRError(Exception):
    """Something was wrong with the input or the machine; the message says what and what to do."""


class TaskFormatError(CRRError):
    """A task row is malformed: the message names the file:line, the field and what was expected."""


class SandboxError(CRRError):
    """Infrastructure failure (missing image, dead container, failed mount): never a reward of 0."""
