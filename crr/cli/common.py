"""What every `crr` command shares: the consoles, `friendly` and `long_command` (a CRRError, or a full or
read-only disk, prints as one red line and exits 2, `crr --debug ...` shows tracebacks; SIGINT/SIGTERM close
sandboxes and say how to resume), where library output goes, JSON output, and the options several commands
take (`engine_option()`...).

Keep this module, like every crr.cli module, light at import time: `crr --help` imports all of them, so
torch, transformers, trl and datasets are imported inside the command functions that use them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from crr.errors import CRRError
from crr.seeds import MAX_SEED


class _Console(Console):
    """A Rich console that word-wraps only on a terminal: off one (a pipe, a log, a scheduler's output
    file) every message stays on one line whatever the width, so that grep finds it whole."""

    def print(self, *objects, soft_wrap: bool | None = None, **kwargs) -> None:
        super().print(*objects, soft_wrap=(not self.is_terminal) if soft_wrap is None else soft_wrap, **kwargs)


console = _Console()
err_console = _Console(stderr=True)
# --debug and --verbose, set by the app callback in crr/cli/__init__.py; "resume" while a command runs.
_state = {"debug": False, "verbose": False}


@contextlib.contextmanager
def _library_output() -> Iterator[None]:
    """Unless --verbose, what libraries say goes to the log of the run directory the command writes
    (rundir.RUN_LOG), not between crr's own lines: Python warnings (transformers' FutureWarnings...) and log
    records from INFO up; Hugging Face progress bars are off. Records from before the command has a run
    directory wait for it (a command that never opens one prints their warnings at its end); crr's own
    warnings are printed as well."""
    if _state["verbose"]:
        yield
        return
    import logging
    import logging.handlers
    import os

    from crr import rundir

    bars = {var: os.environ.get(var) for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    os.environ.update({var: "1" for var, value in bars.items() if value is None})
    # Without a target it keeps every record; once given one (the run log), it passes each on at once.
    pending = logging.handlers.MemoryHandler(capacity=1, flushLevel=logging.CRITICAL + 1)
    pending.setLevel(logging.INFO)
    ours = logging.StreamHandler(sys.stderr)
    ours.setLevel(logging.WARNING)
    ours.addFilter(logging.Filter("crr"))
    ours.setFormatter(logging.Formatter("warning: %(message)s"))

    def to_run_log(path: Path) -> None:
        target = logging.FileHandler(path / rundir.RUN_LOG, encoding="utf-8")
        target.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        previous = pending.target
        pending.setTarget(target)
        pending.flush()
        if previous is not None:
            previous.close()

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(pending)
    root.addHandler(ours)
    logging.captureWarnings(True)
    rundir.writer_hooks.append(to_run_log)
    try:
        yield
    finally:
        rundir.writer_hooks.remove(to_run_log)
        logging.captureWarnings(False)
        root.removeHandler(pending)
        root.removeHandler(ours)
        root.setLevel(level)
        for var, value in bars.items():
            if value is None:
                os.environ.pop(var, None)
        if pending.target is not None:
            pending.target.close()
        else:
            for record in pending.buffer:
                if record.levelno >= logging.WARNING and not record.name.startswith("crr"):
                    err_console.print(f"warning: {record.getMessage()}", highlight=False, markup=False)


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[list[int]]:
    """SIGTERM (what Slurm, Kubernetes and `timeout` send) takes SIGINT's path: a KeyboardInterrupt in
    the main thread, so that the same `finally` blocks close every sandbox. Yields the signals received;
    after the first, more SIGINTs and SIGTERMs are ignored until the process ends (a scheduler's SIGKILL still
    ends it). One that lands inside an import raises once the import has ended (`_importing` says why)."""
    received: list[int] = []
    deferred: list[int] = []           # a signal that landed inside an import, until the import has ended
    ended = threading.Event()          # the command has ended: no signal raises any more
    grace_over = threading.Event()     # the import outlived IMPORT_GRACE_S: raise inside it

    def interrupt(signum, frame) -> None:
        if received or ended.is_set():
            return
        if _importing(frame) and not grace_over.is_set():
            if not deferred:
                deferred.append(signum)
                threading.Thread(target=send_after_import, args=(signum,), daemon=True).start()
            return
        received.append(deferred[0] if deferred else signum)
        raise KeyboardInterrupt

    def send_after_import(signum: int) -> None:
        """Sends the main thread `signum` again whenever it is outside an import (checked every 50 ms), and
        after IMPORT_GRACE_S wherever it is, until the handler has raised: a signal that found the main thread
        already in its next import is sent again."""
        main = threading.main_thread().ident
        deadline = time.monotonic() + IMPORT_GRACE_S
        while not received and not ended.wait(0.05):
            if time.monotonic() > deadline:
                grace_over.set()
            if grace_over.is_set() or not _importing(sys._current_frames().get(main)):
                signal.pthread_kill(main, signum)

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield received
        return
    # SIGINT too: a second Ctrl-C would raise in the `finally` blocks the first one started, leaving sandbox
    # directories behind and exiting by the signal; only where Python raises for it (a job started with SIGINT
    # ignored keeps ignoring it)
    python_raises = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    handled = [signal.SIGTERM, *([signal.SIGINT] if python_raises else [])]
    previous = {signum: signal.signal(signum, interrupt) for signum in handled}
    try:
        yield received
    finally:
        ended.set()
        for signum, handler in previous.items():   # interrupted: the process is on its way out, let it finish
            signal.signal(signum, signal.SIG_IGN if received or deferred else handler)


# How long a Ctrl-C waits for the import it landed in (torch's takes seconds on a slow CPU) before it raises there.
IMPORT_GRACE_S = 60.0


def _importing(frame) -> bool:
    """Whether the main thread is running an import: its frames pass through importlib's bootstrap.
    A KeyboardInterrupt raised there can land inside a native module's initialisation, which Python cannot
    unwind: torch's `_c10d_init` (pybind11) then aborts the process (SIGABRT, `terminate called after throwing
    an instance of 'pybind11::error_already_set'`), with no cleanup and no resume line (CI saw it in
    `crr credit audit`)."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _forget_interrupt_in_exec() -> None:
    """Before Python 3.14, a KeyboardInterrupt that leaves code run by exec() or eval() of a string marks the
    process as stopped by an unhandled Ctrl-C even when it is caught, and the interpreter then exits by SIGINT (-2)
    in place of the command's 130 (cpython gh-128130). dataclasses and namedtuple make their methods that way, so
    a Ctrl-C during an import hits it. An exec() that ends normally clears the mark."""
    exec("")


def _resume_with(command: str) -> None:
    """The command that continues this one's work, printed if it is interrupted."""
    _state["resume"] = command


def _resume_hint() -> str:
    """After an error the user can fix (a full or read-only disk): how to continue once it is fixed."""
    resume = _state.get("resume")
    return f"; finished work is kept: make room (or make it writable), then resume with: {resume}" if resume else ""


def _same_command() -> str:
    return shlex.join(["crr", *sys.argv[1:]])


def print_error(message: str) -> None:
    """crr's error line: `error: MESSAGE`, the first word red, on stderr."""
    err_console.print(Text.assemble(("error:", "bold red"), f" {message}"))


def _exit_with_error(message: str) -> NoReturn:
    """One red error line, exit 2."""
    print_error(message)
    raise typer.Exit(2) from None


def friendly(fn: Callable) -> Callable:
    """One command's errors, interrupts and run directories: a CRRError, or a file the machine refuses (disk full,
    read-only, no permission: rundir.OUTPUT_ERRNOS) or a path that cannot be what it names (rundir.PATH_ERRNOS),
    prints as one line and exits 2 (a traceback with --debug);
    SIGINT or SIGTERM closes its sandboxes, prints how to resume and exits 130 or 143; the run directories it
    wrote are released (their locks) when it ends."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from crr.rundir import OUTPUT_ERRNOS, PATH_ERRNOS, release_locks

        with _sigterm_interrupts() as received, _library_output():
            try:
                return fn(*args, **kwargs)
            except (CRRError, OSError) as e:
                if _state["debug"] or isinstance(e, OSError) and e.errno not in OUTPUT_ERRNOS | PATH_ERRNOS:
                    raise
                _exit_with_error(str(e) if isinstance(e, CRRError) else
                                 f"{e.filename or 'the output'}: {e.strerror}"
                                 + ("" if e.errno in PATH_ERRNOS else _resume_hint()))
            except KeyboardInterrupt:
                _forget_interrupt_in_exec()
                signum = received[0] if received else signal.SIGINT
                resume = _state.get("resume")
                err_console.print(f"interrupted ({signal.Signals(signum).name}); "
                                  + (f"finished work is kept. Resume with: {resume}" if resume else "stopped"),
                                  highlight=False, markup=False)
                raise typer.Exit(128 + signum) from None
            finally:
                _state.pop("resume", None)
                release_locks()

    return wrapper


def long_command(fn: Callable) -> Callable:
    """`friendly`, after freeing what crr processes that no longer exist left behind (containers, snapshot
    images, mounts, sandbox directories): a preempted or killed job never accumulates them. What was freed
    is said once the command starts writing its run directory (and logged there), so that input refused
    before then stays a one-line error."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from crr import rundir
        from crr.sandbox import reclaim_leftovers

        def say(_run: Path) -> None:
            rundir.writer_hooks.remove(say)
            err_console.print(f"reclaimed {len(reclaimed)} leftovers of crr processes that no longer exist "
                              "(`crr sandbox gc --dry-run` lists them)", highlight=False)

        if reclaimed := reclaim_leftovers():
            rundir.writer_hooks.append(say)
        try:
            return fn(*args, **kwargs)
        finally:
            if say in rundir.writer_hooks:
                rundir.writer_hooks.remove(say)

    return friendly(wrapper)


def progress_bar(label: str, *after: Any, disable: bool = False):
    """A Rich progress bar on stderr: `label` (a format string of the task's fields), the bar, done/total,
    the elapsed time, then the `after` columns (columns, or format strings of the task's fields). A command
    that fails before the bar has moved (bad input found inside the work) leaves no bar above its error."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    class Bar(Progress):
        def __exit__(self, exc_type, exc, tb) -> None:
            if exc_type is not None and not any(task.completed for task in self.tasks):
                self.live.transient = True   # erased; and not Progress.stop, which ends a log with a blank line
                self.live.stop()
            else:
                super().__exit__(exc_type, exc, tb)

    return Bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               *(TextColumn(c) if isinstance(c, str) else c for c in after), console=err_console, disable=disable)


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# --- options several commands take --------------------------------------------------------------
# One declaration of each: its flag and the help most commands give it. A command passes its default, and
# its own help where the option means more there (what the seed drives, a default resolved later).

def model_option(default: str = "the cached tiny default, built on first use",
                 what: str = "Model directory or hub id") -> Any:
    """--model; None stands for the command's default model, which `default` describes."""
    return typer.Option(None, "--model", help=f"{what} (default: {default}).")


def policy_option() -> Any:
    """--model of the commands that load a policy through crr.eval.evaluate.resolve_policy."""
    return model_option("the warm-started default if built, else the tiny default",
                        what="Model or LoRA adapter directory, or hub id")


def tasks_option(default: Any) -> Any:
    """--tasks: anything crr.tasks.loaders.load_tasks takes (`...`: required)."""
    return typer.Option(default, "--tasks", help="Task file (JSONL), directory, micro set or dataset.")


ENGINES_HELP = ("local, docker, ray:local or ray:docker (sandboxes on a Ray cluster's nodes, see --ray), or an engine "
                "class by dotted path (pkg.module:Class); its options: --engine-opt")
ENGINE_DEFAULT_LOCAL_HELP = f"Fork engine: {ENGINES_HELP} (default local)."  # for engine_option(None, ...)


def engine_option(default: str | None = "local", help: str = f"Fork engine: {ENGINES_HELP}.") -> Any:
    return typer.Option(default, "--engine", help=help)


def engine_opt_option() -> Any:
    """--engine-opt KEY=VALUE, beside every --engine: the engine's options (crr.sandbox.engines.parse_options)."""
    return typer.Option(None, "--engine-opt", metavar="KEY=VALUE",
                        help="An option of the fork engine, repeatable (docker: image=, mem_limit=4g, cpus=2, "
                             "pool_size=, disk_limit_mb=; local: mem_limit_mb=, ...); the engine checks them.")


def engine_settings(engine: str | None, engine_opt: list[str] | None, ray: str | None = None,
                    mode: str | None = None) -> dict:
    """The engine settings a command was given, as config keys (engine, engine_options, ray, mode): those
    not given are left out, so that a config's own stay. `--mode M` and `--ray A` are sugar for the options
    mode= and address= (crr.sandbox.engine_spec), so the same command line giving one both ways, differently,
    is refused rather than one silently winning."""
    from crr.sandbox import parse_options

    options = parse_options(engine_opt) if engine_opt else None
    for flag, value, key in (("--mode", mode, "mode"), ("--ray", ray, "address")):
        if value is not None and options and key in options and options[key] != value:
            raise CRRError(f"{flag} {value} and --engine-opt {key}={options[key]} disagree; give one of them")
    given = {"engine": engine, "engine_options": options, "ray": ray, "mode": mode}
    return {k: v for k, v in given.items() if v is not None}


def trust_task_code_option() -> Any:
    """`crr --trust-task-code`: for every engine of the command (crr.sandbox.engine_spec reads TRUST_ENV)."""
    return typer.Option(False, "--trust-task-code",
                        help="Run task sets other than crr's own generated ones on a local engine even where "
                             "this host cannot contain their code (no sandbox root filesystem, cgroups or tmpfs; the "
                             "engine says what is missing when it starts).")


def ray_option() -> Any:
    """--ray, beside every --engine: the Ray cluster of a ray:... engine (crr.sandbox.engine_spec)."""
    return typer.Option(None, "--ray", metavar="ADDRESS",
                        help="Ray cluster address, as ray.init takes it (default auto: the cluster this machine "
                             "belongs to; local: a one-node Ray here). Only with --engine ray:local|ray:docker.")


def mode_option(default: str | None = None,
                help: str = "Docker engine mode (docker, ray:docker): commit or overlay.") -> Any:
    return typer.Option(default, "--mode", help=help)


def seed_option(default: int | None = 0, help: str = "Drives every sampling seed.") -> Any:
    return typer.Option(default, "--seed", min=0, max=MAX_SEED, help=help)


def temperature_option(default: float | None = 0.6, help: str = "0 is greedy; 0.6 the paper's rollouts.") -> Any:
    return typer.Option(default, "--temperature", help=help)


def max_new_tokens_option(default: int | None, help: str = "Token budget of one tool call.") -> Any:
    return typer.Option(default, "--max-new-tokens", help=help)


def max_value_chars_option(default: int | None = None,
                           help: str = "Bound every string argument to this many characters (complete calls "
                                       "from untrained models; slower masks).", minimum: int = 1) -> Any:
    """`minimum`: 1, or 0 where 0 means unbounded (`crr rollout bench`); refused as it is parsed, before a model
    loads."""
    return typer.Option(default, "--max-value-chars", min=minimum, help=help)


def threads_option() -> Any:
    return typer.Option(None, "--threads", min=1, help="torch intra-op threads (default: torch's).")


def _out_path(value: str | Path) -> Path:
    """--out's parser: an empty --out, which Path reads as the working directory, is refused as a CRRError
    would be (options are parsed before `friendly` runs)."""
    if str(value):
        return Path(value)
    message = "--out is empty; name where the output goes (--out . for the working directory)"
    if _state["debug"]:
        raise CRRError(message)
    _exit_with_error(message)


def out_option(default: Any = Path("results/runs"), help: str = "Where the run directory goes.") -> Any:
    """--out (`...`: required); an empty one is refused, never taken for the working directory."""
    return typer.Option(default, "--out", parser=_out_path, metavar="PATH", help=help)


def json_option(what: str = "the result") -> Any:
    return typer.Option(False, "--json", help=f"Print {what} as JSON.")
