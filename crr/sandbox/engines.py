"""The engine spec: which fork engine a command or config runs on, and its options, as one value.

    spec = engine_spec("docker", {"mode": "overlay", "image": "crr-base:bookworm", "mem_limit": "4g"})
    with spec.make() as engine: ...

An engine is named by

  - a registered name: `local`, `docker` (or one a plugin registered: `register_engine(name, cls)`);
  - a dotted path to an engine class outside crr: `pkg.module:Class` or `pkg.module.Class`;
  - `ray:<engine>`: that engine on every node of a Ray cluster (crr.sandbox.ray_engine); the wrapper's own
    options are RAY_OPTIONS (`address`, ...), the rest go to the inner engine on each node.

The options are the engine class's constructor keywords, and the engine validates them itself: a keyword
its constructor does not take is a CRRError (one line, exit 2); a value its class's `OPTIONS` (name ->
`Option`: the type and range each option takes) refuses is one too, before anything starts. Configs carry
`engine` (the name) and `engine_options` (a mapping); commands take `--engine NAME` and `--engine-opt
KEY=VALUE` (repeatable), with `--ray ADDRESS` and `--mode MODE` as sugar for the options `address` and `mode`.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crr.errors import CRRError
from crr.plugins import import_callable
from crr.sandbox.base import ForkEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Option:
    """What an engine option takes, as an engine class declares it in its OPTIONS (name -> Option): a value
    of `kind` (int, float, bool, str or Path; a float takes an int too), from `least` to `most` where
    given (`above`: more than that), one of `choices` where given, or None where `none` (the engine's
    default). `note` says what the number counts (MB) or why the range. A `pattern` is a regular expression
    the value (a string, or a whole number) matches whole, and `note` then says what it takes."""

    kind: type
    least: float | None = None
    most: float | None = None
    above: float | None = None
    choices: tuple = ()
    none: bool = False
    note: str = ""
    pattern: str = ""

    def refuses(self, value: Any) -> bool:
        if value is None:
            return not self.none
        if self.choices:
            return value not in self.choices
        if self.pattern:
            return isinstance(value, bool) or not isinstance(value, (str, int)) or not re.fullmatch(self.pattern,
                                                                                                     str(value))
        if self.kind is Path:
            return not (isinstance(value, (str, os.PathLike)) and str(value))
        kinds = (int, float) if self.kind is float else self.kind
        if not isinstance(value, kinds) or (isinstance(value, bool) and self.kind is not bool):
            return True
        low, high, above = self.least, self.most, self.above
        return (low is not None and value < low) or (high is not None and value > high) or (
            above is not None and value <= above)

    def allowed(self) -> str:
        """What it takes, as the end of an error message."""
        if self.choices:
            *rest, last = map(str, self.choices)
            return "choose " + (f"{', '.join(rest)} or {last}" if rest else last)
        if self.pattern:
            return f"must be {self.note}"
        what = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
                Path: "a path"}[self.kind]
        if self.least is not None and self.most is not None:
            what += f" from {self.least} to {self.most}"
        elif self.least is not None:
            what += f" >= {self.least}"
        elif self.above is not None:
            what += f" > {self.above}"
        what += " (or null)" if self.none else ""
        return f"must be {what}" + (f" ({self.note})" if self.note else "")


def check_values(name: str, options: Mapping[str, Any], declared: Mapping[str, Option]) -> None:
    """A CRRError naming the first option of `options` whose value its declaration refuses."""
    for key, value in options.items():
        if key in declared and declared[key].refuses(value):
            raise CRRError(f"fork engine {name!r} option {key}={value!r}: {declared[key].allowed()}")


RAY_PREFIX = "ray:"  # ray:<engine>: sandboxes on a Ray cluster's nodes
# The options of the ray:... wrapper itself (crr.sandbox.ray_engine.RayEngine's keywords); the rest of a
# ray:<engine>'s options go to <engine>. Named here so that checking a spec needs no import of ray.
RAY_OPTIONS = {
    "address": Option(str, none=True), "resource": Option(str), "cpus_per_sandbox": Option(float, above=0),
    "call_timeout_s": Option(float, above=0, note="s"), "start_timeout_s": Option(float, above=0, note="s"),
    "exec_margin_s": Option(float, least=0, note="s"), "rescan_s": Option(float, least=0, note="s")}
TRUST_ENV = "CRR_TRUST_TASK_CODE"  # =1: `crr --trust-task-code`, for every engine this process and its workers make

# name -> engine class (or factory), or the dotted path to one: imported when an engine of that name is
# checked or made (the Docker SDK, ~50 ms of the local engine's imports: not for `crr --help`).
ENGINES: dict[str, Callable[..., ForkEngine] | str] = {"local": "crr.sandbox.local:LocalEngine",
                                                       "docker": "crr.sandbox.docker:DockerEngine"}


def register_engine(name: str, factory: Callable[..., ForkEngine] | str) -> None:
    """Make the engine name `name` stand for `factory` (an engine class, a callable taking its options, or
    the dotted path to one): `get_engine(name, **opts)` returns `factory(**opts)`."""
    ENGINES[name] = factory


def engine_class(name: str) -> Callable[..., ForkEngine]:
    """The class (or factory) an engine name stands for: a registered one, or one by dotted path."""
    ref = ENGINES.get(name, name)
    if not isinstance(ref, str):
        return ref
    found = import_callable(ref, "fork engine")
    if found is None:
        raise CRRError(f"unknown fork engine {name!r}; choose one of {', '.join(ENGINES)}, ray:<engine>, or "
                       "the dotted path to an engine class (pkg.module:Class)")
    return found


def check_options(name: str, factory: Callable[..., ForkEngine], options: Mapping[str, Any]) -> None:
    """The engine's own check of its options: the keywords its constructor takes, then the values, as its
    class declares them (OPTIONS). A CRRError names what is wrong."""
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = [p for p, v in params.items() if v.kind in (v.KEYWORD_ONLY, v.POSITIONAL_OR_KEYWORD)]
        if unknown := sorted(set(options) - set(takes)):
            raise CRRError(f"fork engine {name!r} takes no option {', '.join(unknown)}; its options: "
                           f"{', '.join(takes) or 'none'}")
    check_values(name, options, getattr(factory, "OPTIONS", {}))


def _takes(factory: Callable[..., ForkEngine], option: str) -> bool:
    return option in inspect.signature(factory).parameters


@dataclass(frozen=True)
class EngineSpec:
    """A fork engine by name (registered, dotted path, or ray:<engine>) with its options, checked."""

    name: str
    options: dict = field(default_factory=dict)

    def make(self, **extra) -> ForkEngine:
        """The engine, with `extra` options on top (the filter's recording engine: record_http=True)."""
        return get_engine(self.name, **self.options, **extra)


def get_engine(name: str, **opts) -> ForkEngine:
    """A fork engine by name with its options (LocalEngine's, DockerEngine's constructor keywords), checked
    by the engine first. `ray:<engine>` builds the Ray wrapper around <engine> (ray imported only then)."""
    if name.startswith(RAY_PREFIX):
        inner = name.removeprefix(RAY_PREFIX)
        factory = engine_class(inner)
        check_values(name, opts, RAY_OPTIONS)
        check_options(name, factory, {k: v for k, v in opts.items() if k not in RAY_OPTIONS})
        # deferred: importing ray costs ~0.3 s (more on a busy machine) that `crr --help` and the light
        # commands need not pay; only an engine named ray:... does (ray is the optional `ray` extra).
        try:
            from crr.sandbox.ray_engine import RayEngine
        except ImportError as e:
            raise CRRError(f"engine {name} needs Ray: pip install -e '.[ray]' ({e})") from None
        return RayEngine(inner, factory=factory, **opts)
    factory = engine_class(name)
    check_options(name, factory, opts)
    return factory(**opts)


def engine_spec(engine: str | EngineSpec, options: Mapping[str, Any] | None = None, *, ray: str | None = None,
                mode: str | None = None, trust_task_code: bool | None = None) -> EngineSpec:
    """The checked spec of an engine as commands and configs give it: a name and its options, plus the
    sugar `ray` (a Ray cluster's address as ray.init takes it: the option `address` of a ray:... engine)
    and `mode` (the option `mode`, which the Docker engines take). `trust_task_code` (None:
    $CRR_TRUST_TASK_CODE, which `crr --trust-task-code` sets) goes to an engine that takes it (the local
    engine, which cannot contain task code on every host). Whatever the engine does not take is a CRRError,
    which a command prints as one line (exit 2), before anything is built."""
    if isinstance(engine, EngineSpec):
        engine, options = engine.name, {**engine.options, **(options or {})}
    if not isinstance(engine, str) or not engine:
        raise CRRError(f"an engine is a name or the dotted path to an engine class, got {engine!r}")
    if options is not None and not isinstance(options, Mapping):
        raise CRRError(f"engine_options is a mapping of option: value, got {options!r}")
    opts = dict(options or {})
    on_ray = engine.startswith(RAY_PREFIX)
    if ray is not None:
        if not on_ray:
            raise CRRError(f"a Ray address (--ray {ray}) applies to a ray:<engine> engine only, not to "
                           f"{engine!r}")
        opts["address"] = ray
    if mode is not None:
        opts["mode"] = mode
    factory = engine_class(engine.removeprefix(RAY_PREFIX))
    if trust_task_code is None:
        trust_task_code = os.environ.get(TRUST_ENV) == "1"
    if trust_task_code and _takes(factory, "trust_task_code"):
        opts.setdefault("trust_task_code", True)
    inner = {k: v for k, v in opts.items() if not (on_ray and k in RAY_OPTIONS)}
    if on_ray:
        check_values(engine, opts, RAY_OPTIONS)
    check_options(engine, factory, inner)
    return EngineSpec(engine, opts)


def engine_spec_of(settings: Any) -> EngineSpec:
    """The checked spec of a config (or a mapping of settings) that carries the keys `engine`,
    `engine_options`, `ray` and `mode` (absent ones: none)."""
    get = settings.get if isinstance(settings, Mapping) else lambda key: getattr(settings, key, None)
    return engine_spec(get("engine") or "local", get("engine_options"), ray=get("ray"), mode=get("mode"))


def parse_options(pairs: Iterable[str]) -> dict:
    """`--engine-opt KEY=VALUE` (repeatable) as options: each value read as YAML (4g stays a string, 2 is
    an int, true a bool), as the same key in a config file would be."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise CRRError(f"--engine-opt takes KEY=VALUE (an engine option and its value), got {pair!r}")
        try:
            out[key.strip()] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def engine_workers(engine: ForkEngine, workers: int | None, default: int) -> int:
    """How many worker threads a driver (the rollout's pool, the filter, an evaluation) runs on `engine`:
    `workers` when the user set it; else the engine's `slots` where it has them (a Ray engine: the commands
    its cluster runs at once), else `default`."""
    if workers is not None:
        return workers
    slots = getattr(engine, "slots", None)
    if isinstance(slots, int) and slots > 0:
        log.info("%d workers: the sandbox slots of the %s engine", slots, getattr(engine, "name", "fork"))
        return slots
    return default
