"""What a config value must be, as `crr train` and `crr credit audit` check theirs before anything is made: of
its field's annotated type, finite where it is a number, and within its field's range (RANGES). Kept apart from
crr.train.config so that checking a value imports neither torch nor TRL (`crr report` reads audits with it)."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass
from enum import Enum

from crr.errors import CRRError
from crr.seeds import MAX_SEED


@dataclass(frozen=True)
class Range:
    """Where a number (each number, of a list) must lie; `unset` is a value that means "not set" (TRL's -1)."""
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    unset: float | None = None

    def holds(self, value) -> bool:
        if isinstance(value, (list, tuple)):
            return all(self.holds(v) for v in value)
        if value is None or isinstance(value, (bool, str)) or value == self.unset and self.unset is not None:
            return True
        return ((self.low is None or value > self.low or (value == self.low and not self.open_low))
                and (self.high is None or value <= self.high))

    def __str__(self) -> str:
        low = None if self.low is None else f"{'>' if self.open_low else '>='} {_number(self.low)}"
        text = (low if self.high is None else
                f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}]" if self.low is not None
                else f"<= {_number(self.high)}")
        return text + ("" if self.unset is None else f" (or {_number(self.unset)}: unset)")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"   # a bound such as 2**32 - 1 in full


_POSITIVE, _NON_NEGATIVE, _AT_LEAST_1, _UNIT = Range(0, open_low=True), Range(0), Range(1), Range(0, 1)
# The ranges of the fields whose type alone admits values that fail later (or silently do something else):
# CRR's fields and the TRL/transformers knobs a run sets. A field's type is checked from its annotation.
# rollout_temperature > 0: greedy rollouts make the G siblings of a group identical (no advantage to learn).
RANGES: dict[str, Range] = {
    **dict.fromkeys(("learning_rate", "temperature", "rollout_temperature", "cf_temperature", "epsilon",
                     "episode_time_limit_s", "budget_hours", "lora_alpha", "num_train_epochs", "top_p"), _POSITIVE),
    **dict.fromkeys(("beta", "k", "eta", "lambda_type", "weight_decay", "warmup_steps", "max_grad_norm", "adam_epsilon",
                     "dataloader_num_workers"), _NON_NEGATIVE),
    "seed": Range(0, MAX_SEED),
    **dict.fromkeys(("tasks_per_iteration", "max_turns", "max_new_tokens", "cf_samples", "save_every",
                     "diagnostics_every", "workers", "n_tasks", "max_trajectories", "lora_r", "horizon",
                     "num_iterations", "logging_steps", "fork_cost_multiplier"),
                    _AT_LEAST_1),
    **dict.fromkeys(("replay_noise", "adam_beta1", "adam_beta2", "warmup_ratio"), _UNIT),
    "num_generations": Range(2),   # GRPO's advantage needs at least two siblings
    "max_steps": Range(1, unset=-1),
    "checkpoint_fractions": Range(0, 1, open_low=True),
}


def conforms(value, hint) -> bool:
    """Whether `value` (as YAML gives it) has the type `hint` (a dataclass field's annotation) names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint in (int, float) or hint is bool:   # YAML's true/false is no number, and 2.0 no int
        return (isinstance(value, bool) if hint is bool else not isinstance(value, bool)
                and isinstance(value, int if hint is int else (int, float)))
    if origin in (list, tuple) or hint in (list, tuple):
        return isinstance(value, (list, tuple)) and all(conforms(v, args[0]) for v in value if args)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return isinstance(value, hint) or value in {m.value for m in hint}
    return isinstance(value, hint) if isinstance(hint, type) else True


def describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(a) for a in args))
    if origin is typing.Literal or isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(map(str, args if origin else [m.value for m in hint]))
    if origin in (list, tuple):
        return f"a list whose items are each {describe(args[0])}" if args else "a list"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping"}
    return names.get(origin or hint, getattr(hint, "__name__", str(hint)))


def check_value(name: str, value, hint, limits: Range | None = None, where: str = "") -> None:
    """A CRRError (after `where`) unless `value` has the type `hint` names, is finite where it is a number, and
    lies within `limits`."""
    if not conforms(value, hint):
        raise CRRError(f"{where}{name}={value!r}: expected {describe(hint)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CRRError(f"{where}{name}={value!r}: expected a finite number")
    if limits is not None and not limits.holds(value):
        raise CRRError(f"{where}{name}={value!r}: must be {limits}")
