"""What a config or command names by dotted path (`pkg.module:attr` or `pkg.module.attr`): an advantage
estimator, a fork engine class. One resolver, so every such name fails the same way: one CRRError line."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from crr.errors import CRRError


def import_callable(ref: str, what: str) -> Callable | None:
    """The callable `ref` names, or None when `ref` is not a dotted path. `what` names it in errors
    ("fork engine", "advantage estimator")."""
    module, sep, attr = ref.partition(":") if ":" in ref else ref.rpartition(".")
    if not (sep and module and attr):
        return None
    try:
        found = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise CRRError(f"{what} {ref!r}: cannot import {module} ({e})") from None
    except AttributeError:
        raise CRRError(f"{what} {ref!r}: {module} has no {attr}") from None
    if not callable(found):
        raise CRRError(f"{what} {ref!r} is not callable")
    return found
