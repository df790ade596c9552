"""The `crr` command line: thin over the library. Parses options, calls crr.*, renders with Rich.

Errors of the CRRError family print as one red line and exit 2; `crr --debug ...` shows tracebacks.
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

import typer
from rich.console import Console
from rich.text import Text

from crr.errors import CRRError

app = typer.Typer(help="Counterfactual Rollout Replay: step-level credit for SWE agents from forkable "
                       "sandboxes.", no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")


class _Console(Console):
    """A Rich console that word-wraps only on a terminal: off one (a pipe, a log, a scheduler's output
    file) every message stays on one line whatever the width, so that grep finds it whole."""

    def print(self, *objects, soft_wrap: bool | None = None, **kwargs) -> None:
        super().print(*objects, soft_wrap=(not self.is_terminal) if soft_wrap is None else soft_wrap, **kwargs)


console = _Console()
err_console = _Console(stderr=True)
_state = {"debug": False, "verbose": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for crr errors."),
          verbose: bool = typer.Option(False, "--verbose", help="Show what libraries say (warnings, log records, "
                                       "progress bars) here instead of in the run directory's crr.log.")) -> None:
    _state["debug"], _state["verbose"] = debug, verbose


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
    one more SIGTERM while the command cleans up is ignored (a scheduler's SIGKILL still ends it)."""
    received: list[int] = []

    def interrupt(signum, frame) -> None:
        if not received:
            received.append(signum)
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield received
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resume_with(command: str) -> None:
    """The command that continues this one's work, printed if it is interrupted."""
    _state["resume"] = command


def _same_command() -> str:
    return shlex.join(["crr", *sys.argv[1:]])


def friendly(fn: Callable) -> Callable:
    """One command's errors, interrupts and run directories: a CRRError prints as one line and exits 2 (a
    traceback with --debug); SIGINT or SIGTERM closes its sandboxes, prints how to resume and exits 130 or
    143; the run directories it wrote are released (their locks) when it ends."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from crr.rundir import release_locks

        with _sigterm_interrupts() as received, _library_output():
            try:
                return fn(*args, **kwargs)
            except CRRError as e:
                if _state["debug"]:
                    raise
                err_console.print(Text.assemble(("error:", "bold red"), f" {e}"))
                raise typer.Exit(2) from None
            except KeyboardInterrupt:
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
    images, mounts, sandbox directories): a preempted or killed job never accumulates them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from crr.replay import reclaim_leftovers

        if reclaimed := reclaim_leftovers():
            err_console.print(f"reclaimed {len(reclaimed)} leftovers of crr processes that no longer exist "
                              "(`crr sandbox gc --dry-run` lists them)", highlight=False)
        return fn(*args, **kwargs)

    return friendly(wrapper)


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# Commands are added below, one section per area (tasks, sandbox/fork, tool, doctor, demo).
# ---------------------------------------------------------------------------------------------


# --- doctor -----------------------------------------------------------------------------------
@app.command()
@friendly
def doctor(as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON.")) -> None:
    """Check Python, torch, TRL, swebench, the Docker daemon, the base image, overlayfs, network
    namespaces and free disk; print what is missing and the command that fixes it."""
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


# --- fork -------------------------------------------------------------------------------------
fork_app = typer.Typer(help="Fork engines: benchmark snapshot/restore latency.", no_args_is_help=True)
app.add_typer(fork_app, name="fork")


@fork_app.command("bench")
@friendly
def fork_bench_cmd(
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str = typer.Option(None, "--mode", help="local: overlay|copy; docker: overlay|commit; or both."),
    files: int = typer.Option(5000, "--files", help="Files in the synthetic repository."),
    repeats: int = typer.Option(20, "--repeats", help="Timed forks."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time snapshot, restore and fork (snapshot + restore + `true` in the fork) on a synthetic repo."""
    from rich.table import Table

    from crr.replay.bench import fork_bench

    with err_console.status(f"fork bench: {engine} engine, {files} files, {repeats} repeats"):
        result = fork_bench(engine, mode, n_files=files, repeats=repeats)
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"crr fork bench: {engine} engine, {files} files, {repeats} repeats (ms)")
    table.add_column("mode")
    for col in ("snapshot p50/p95", "restore p50/p95", "fork p50/p95", "exact"):
        table.add_column(col, justify="right")
    for r in result.get("modes", {"": result}).values():
        table.add_row(r["mode"], *(f"{r[f'{k}_ms_p50']:.1f} / {r[f'{k}_ms_p95']:.1f}"
                                   for k in ("snapshot", "restore", "fork")),
                      "[green]yes[/]" if r["exact"] else "[red]NO[/]")
    console.print(table)
    for key, ratio in result.items():
        if key.endswith("_fork_ratio"):
            console.print(f"{key}: {ratio:.1f}x")


# --- tool -------------------------------------------------------------------------------------
@app.command("tool")
@friendly
def tool_command(
    tasks: str = typer.Option(..., "--tasks", help="A JSONL file, a directory, micro-train, a dataset."),
    instance: str = typer.Option(..., "--instance", help="instance_id of the task to open."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay."),
    call: str | None = typer.Option(None, "--call", help='One tool call, e.g. \'{"name": "view_file", '
                                    '"arguments": {"path": "setup.py"}}\'.'),
    script: Path | None = typer.Option(None, "--script", exists=True, dir_okay=False,
                                       help="A JSON list or JSONL file of tool calls."),
    run_verifier: bool = typer.Option(False, "--verify", help="Run the held-out tests at the end."),
    as_json: bool = typer.Option(False, "--json", help="Print observations (and the verdict) as JSON."),
) -> None:
    """Run tool calls in a fresh sandbox of one task and show each observation."""
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from crr.agent.tools import ToolCallError, execute, parse_tool_call, script_calls
    from crr.agent.verifier import verify
    from crr.replay import get_engine
    from crr.tasks.loaders import load_tasks

    if (call is None) == (script is None):
        raise CRRError("give exactly one of --call JSON or --script FILE")
    if mode is not None and engine != "docker":
        raise CRRError("--mode applies to --engine docker only")
    texts = [call] if call is not None else script_calls(script.read_text())
    by_id = {t.instance_id: t for t in load_tasks(tasks)}
    if instance not in by_id:
        raise CRRError(f"no task {instance!r} in {tasks}; it has e.g. {', '.join(list(by_id)[:5]) or 'none'}")
    task = by_id[instance]
    fork_engine = get_engine(engine, **({"mode": mode} if mode else {}))
    records = []
    try:
        with fork_engine.start(task) as sb:
            for text in texts:
                try:
                    parsed = parse_tool_call(text)
                    title = f"{parsed.name} {json.dumps(parsed.arguments, ensure_ascii=False)}"
                except ToolCallError:
                    parsed, title = text, "invalid tool call"
                obs = execute(sb, parsed)
                records.append({"call": text, "observation": obs.text, "is_error": obs.is_error,
                                "terminal": obs.terminal})
                if not as_json:
                    style = "red" if obs.is_error else "green" if obs.terminal else "blue"
                    console.print(Panel(Text(obs.text.rstrip("\n")), title=Text(title), title_align="left",
                                        border_style=style))
                if obs.terminal:
                    break
            result = verify(sb, task) if run_verifier else None
    finally:
        fork_engine.close()
    if as_json:
        emit_json({"instance_id": instance, "steps": records,
                   "verifier": result.to_dict() if result else None})
    elif result is not None:
        verdict = (f"[red]infra error:[/] {escape(result.infra_error)}" if result.infra_error else
                   f"reward [bold]{result.reward:g}[/] ({result.resolution})"
                   + (f" — {escape(result.note)}" if result.note else ""))
        console.print(verdict, highlight=False)
        table = Table("held-out test", "status")
        for test_id, status in result.statuses.items():
            table.add_row(Text(test_id), Text(status, style="green" if status == "PASSED" else "red"))
        if result.statuses:
            console.print(table)


# --- model ------------------------------------------------------------------------------------
model_app = typer.Typer(help="The policy model: build the tiny default, sample tool calls from a model.",
                        no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("init")
@friendly
def model_init(
    out: Path = typer.Option(..., "--out", help="New directory for the model and tokenizer."),
    size: str = typer.Option("tiny", "--size", help="tiny (~4.4M parameters) or small (~13.8M)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random initial weights."),
) -> None:
    """Build the embedded default policy: a random Qwen3-architecture model and a byte-level BPE
    tokenizer trained offline, with a chat template TRL recognises for tool calling."""
    from crr.policy.model import CHAT_TEMPLATE, init_tiny_model, load_policy, param_count

    with err_console.status(f"training the tokenizer and building a {size} model"):
        path = init_tiny_model(out, seed=seed, size=size)
    model, tokenizer = load_policy(path)
    console.print(f"{size} Qwen3 model: [bold]{param_count(model):,}[/] parameters, vocab "
                  f"[bold]{len(tokenizer):,}[/], chat template {CHAT_TEMPLATE} (TRL) -> {path}", highlight=False)


@model_app.command("generate")
@friendly
def model_generate(
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the cached "
                                     "tiny default, built on first use)."),
    prompt: str = typer.Option(..., "--prompt", help="The user message (after the paper's system prompt)."),
    temperature: float = typer.Option(0.6, "--temperature", help="0 is greedy; 0.6 the paper's rollouts."),
    n: int = typer.Option(4, "--n", help="Samples (one batch)."),
    seed: int = typer.Option(0, "--seed"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    max_value_chars: int | None = typer.Option(None, "--max-value-chars", help="Bound every string "
                                               "argument to this many characters (complete calls from "
                                               "untrained models)."),
    as_json: bool = typer.Option(False, "--json", help="Print the samples as JSON."),
) -> None:
    """Sample grammar-constrained tool calls and show each with its step entropy H_t and grammar
    rejections."""
    import dataclasses

    from rich.table import Table

    from crr.agent.prompt import SYSTEM_PROMPT
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import default_model_dir, load_policy

    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    if model is None:
        with err_console.status("loading the default tiny model (built on first use)"):
            model = str(default_model_dir())
    backend = TransformersBackend(*load_policy(model), max_value_chars=max_value_chars)
    conversation = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    start = time.perf_counter()
    samples = backend.generate([conversation] * n, temperature=temperature, seed=seed,
                               max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - start
    if as_json:
        emit_json([{**dataclasses.asdict(s), "rejection_rate": s.rejection_rate} for s in samples])
        return
    table = Table(title=f"{n} tool calls from {model} (T={temperature:g}, seed {seed})")
    for col, justify in (("#", "right"), ("tool call", "left"), ("tokens", "right"), ("H_t", "right"),
                         ("rejected", "right"), ("complete", "left")):
        table.add_column(col, justify=justify)
    for i, s in enumerate(samples):
        table.add_row(str(i), Text(s.text), str(len(s.action_ids)), f"{s.entropy:.3f}",
                      f"{s.grammar_rejections}/{len(s.action_ids)}",
                      "[red]truncated[/]" if s.truncated else "[green]yes[/]")
    console.print(table)
    tokens = sum(len(s.action_ids) for s in samples)
    rejected = sum(s.grammar_rejections for s in samples)
    console.print(f"grammar rejection rate {rejected / max(tokens, 1):.1%} ({rejected}/{tokens} tokens); "
                  f"{tokens / elapsed:.0f} tokens/s", highlight=False)


# --- tasks ------------------------------------------------------------------------------------
tasks_app = typer.Typer(help="Task sets: generate the embedded micro set; validate and inspect task files "
                             "and datasets.", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")


@tasks_app.command("micro")
@friendly
def tasks_micro(
    n: int = typer.Option(32, "--n", help="Number of tasks."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same tasks, byte for byte."),
    split: str = typer.Option("train", "--split", help="train or test (disjoint templates; for nano, disjoint "
                              "vocabularies)."),
    tier: str = typer.Option("default", "--tier", help="default (templates, fillers, decoys: 3-20 modules) or nano "
                             "(1-3 short modules with procedural names: the learnable CPU tier)."),
    flaky_rate: float = typer.Option(0.0, "--flaky-rate", help="Fraction of tasks with one labelled flaky test."),
    workers: int = typer.Option(1, "--workers", help="Processes generating tasks (same rows for any number)."),
    warm: bool = typer.Option(True, "--warm-pytest/--fresh-pytest", help="Measure tests in forks of a warm pytest "
                              "worker (default) or a fresh interpreter per run: same rows, compare the rates."),
    first: int = typer.Option(0, "--first", help="Index of the first task: a large set in chunks (chunk rows equal "
                              "the whole set's)."),
    out: Path = typer.Option(..., "--out", help="New (or empty) directory for tasks.jsonl and repos/."),
) -> None:
    """Generate micro tasks: small Python packages with one injected bug each, an issue, a gold
    patch and held-out tests whose FAIL_TO_PASS/PASS_TO_PASS are measured by running pytest."""
    from collections import Counter

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from crr.tasks.micro import generate_micro

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console) as bar:
        job = bar.add_task(f"{tier} {split} (seed {seed})", total=n)
        start = time.perf_counter()
        tasks = generate_micro(out, n=n, seed=seed, split=split, flaky_rate=flaky_rate, tier=tier, workers=workers,
                               first=first, warm=warm, progress=lambda _: bar.advance(job))
        elapsed = time.perf_counter() - start
    tiers = ("easy", "medium", "hard")
    counts = Counter((t.metadata["bug_family"], t.metadata["difficulty"]) for t in tasks)
    per_tier = Counter(t.metadata["difficulty"] for t in tasks)
    table = Table(title=f"{len(tasks)} micro tasks ({split}, seed {seed})")
    table.add_column("bug family")
    for col in (*tiers, "total"):
        table.add_column(col, justify="right")
    for family in sorted({f for f, _ in counts}):
        row = [counts[(family, tier)] for tier in tiers]
        table.add_row(family, *map(str, row), str(sum(row)))
    table.add_row("[bold]total[/]", *(str(per_tier[t]) for t in tiers), f"[bold]{len(tasks)}[/]")
    console.print(table)
    flaky = sum(1 for t in tasks if t.metadata.get("flaky"))
    console.print(f"{flaky} with a labelled flaky test; {len(tasks) / elapsed:.2f} tasks/s with {workers} "
                  f"worker(s); wrote {Path(out) / 'tasks.jsonl'}", highlight=False)


@tasks_app.command("bench")
@friendly
def tasks_bench(
    n: int = typer.Option(200, "--n", help="Tasks to generate (into a throw-away directory)."),
    seed: int = typer.Option(0, "--seed", help="Generator seed."),
    split: str = typer.Option("train", "--split", help="train or test."),
    tier: str = typer.Option("nano", "--tier", help="default or nano."),
    workers: int = typer.Option(1, "--workers", help="Generating processes."),
    warm: bool = typer.Option(True, "--warm-pytest/--fresh-pytest", help="Warm pytest worker or a fresh "
                              "interpreter per pytest run."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time task generation (tasks/s) and describe what it made: bug families, file sizes, issue length."""
    from rich.table import Table

    from crr.tasks.micro import bench_micro

    with err_console.status(f"generating {n} {tier} {split} tasks ({workers} worker(s), "
                            f"{'warm' if warm else 'fresh'} pytest)"):
        result = bench_micro(n, seed=seed, split=split, tier=tier, workers=workers, warm=warm)
    if json_out:
        console.print_json(json.dumps(result))
        return
    console.print(f"{result['tasks_per_s']:.2f} tasks/s: {n} {tier} {split} tasks in {result['seconds']:.1f}s with "
                  f"{workers} worker(s), {'warm' if warm else 'fresh'} pytest", highlight=False)
    families = Table(title="bug families")
    families.add_column("family")
    families.add_column("tasks", justify="right")
    for family, count in result["families"].items():
        families.add_row(family, str(count))
    console.print(families)
    files = Table(title=f"files at base_commit (first {min(n, 50)} tasks); issue {result['issue_chars']:.0f} chars")
    for col in ("kind", "per task", "lines", "chars", "tokens"):
        files.add_column(col, justify="left" if col == "kind" else "right")
    for kind, row in result["files"].items():
        files.add_row(kind, f"{row['per_task']:.2f}", f"{row['mean_lines']:.1f}", f"{row['mean_chars']:.0f}",
                      f"{row['mean_tokens']:.0f}")
    console.print(files)


@tasks_app.command("synth")
@long_command
def tasks_synth(
    package: list[str] = typer.Option([], "--package", help="NAME==VERSION of a PyPI package whose sdist "
                                      "carries its tests (repeatable)."),
    curated: bool = typer.Option(False, "--curated", help="Every package of crr/tasks/packages.yaml."),
    n: int = typer.Option(2, "--n", help="Tasks per package (at most)."),
    out: Path = typer.Option(..., "--out", help="New (or empty) directory for tasks.jsonl; an interrupted "
                             "run's directory resumes."),
    seed: int = typer.Option(0, "--seed", help="Seed of the order bugs are tried in and of the issue texts."),
    requires: list[str] = typer.Option([], "--requires", help="Extra test requirement for --package, e.g. "
                                       "hypothesis==6.100.0 (repeatable)."),
    engine: str = typer.Option("local", "--engine", help="Sandbox engine for the test runs: local or docker."),
    max_candidates: int = typer.Option(30, "--max-candidates", help="Candidate bugs run per package."),
) -> None:
    """Tasks from real packages: the sdist becomes a git repository, its own test suite runs in a
    sandbox, SWE-smith's procedural modifiers inject bugs, and bugs that break passing tests become
    SWE-bench rows (F2P/P2P measured, issue text from the failing test)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from crr.tasks.synth import curated as curated_packages
    from crr.tasks.synth import parse_package, synthesise

    specs = [parse_package(p, tuple(requires)) for p in package] + (curated_packages() if curated else [])
    _resume_with(_same_command())  # its --out resumes
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=err_console) as bar:
        jobs: dict[str, int] = {}

        def progress(state) -> None:
            if state.package not in jobs:
                jobs[state.package] = bar.add_task(state.package, total=n, note="")
            bar.update(jobs[state.package], completed=state.tasks,
                       note=f"{state.candidates} candidate bugs tried")

        tasks = synthesise(specs, out, n=n, seed=seed, engine=engine, max_candidates=max_candidates,
                           progress=progress)
    table = Table(title=f"{len(tasks)} tasks from {len(specs)} package(s)")
    for col in ("instance_id", "bug", "#F2P", "#P2P"):
        table.add_column(col, justify="right" if col.startswith("#") else "left")
    for t in tasks:
        table.add_row(t.instance_id, f"{t.metadata['bug_strategy']} in {t.metadata['buggy_entity']}",
                      str(len(t.FAIL_TO_PASS)), str(len(t.PASS_TO_PASS)))
    console.print(table)
    console.print(f"wrote {Path(out) / 'tasks.jsonl'}", highlight=False)


@tasks_app.command("show")
@friendly
def tasks_show(
    source: str = typer.Argument(..., help="A JSONL file, a directory with tasks.jsonl, micro-train/micro-test, "
                                           "a dataset name, a save_to_disk directory or a .parquet file."),
    split: str | None = typer.Option(None, "--split", help="Dataset split (datasets only)."),
    adapter: str | None = typer.Option(None, "--adapter", help="Dataset adapter for local copies: swe-bench, "
                                       "swe-gym, swe-rebench, swe-bench-live, generic."),
    limit: int | None = typer.Option(None, "--limit", help="Show at most this many tasks."),
    as_json: bool = typer.Option(False, "--json", help="Print the validated rows as JSON."),
) -> None:
    """Validate a task set and list its tasks (bad rows exit 2 with FILE:LINE and the field)."""
    from rich.table import Table

    from crr.tasks.loaders import load_tasks

    tasks = load_tasks(source, split, adapter=adapter)
    shown = tasks if limit is None else tasks[:limit]
    if as_json:
        emit_json([t.to_row() for t in shown])
        return
    table = Table(title=f"{len(tasks)} tasks from {source}" + (f" (first {len(shown)})" if len(shown) < len(tasks) else ""))
    table.add_column("instance_id")
    table.add_column("repo")
    table.add_column("#F2P", justify="right")
    table.add_column("#P2P", justify="right")
    table.add_column("difficulty")
    for t in shown:
        difficulty = t.metadata.get("difficulty") or t.extra.get("difficulty") or ""
        table.add_row(Text(t.instance_id), Text(t.repo), str(len(t.FAIL_TO_PASS)), str(len(t.PASS_TO_PASS)),
                      Text(str(difficulty)))
    console.print(table)


@tasks_app.command("band")
@friendly
def tasks_band(
    eval_run: Path = typer.Argument(..., help="A sampled `crr eval` run of the starting policy on a candidate pool "
                                    "(--samples n at the rollout temperature)."),
    low: float = typer.Option(0.25, "--low", help="Lowest solve rate c/n kept."),
    high: float = typer.Option(0.75, "--high", help="Highest solve rate c/n kept."),
    out: Path = typer.Option(..., "--out", help="New directory for tasks.jsonl, repos/ and band.json."),
) -> None:
    """The learnable band: the pool's tasks whose sampled solve rate under the starting policy lies in
    [--low, --high], written with their repositories as a self-contained task set for training."""
    from crr.eval.band import band_from_eval

    s = band_from_eval(eval_run, out, low, high)
    console.print(f"{s['selected']} of {s['evaluated']} tasks with a solve rate in [{low:g}, {high:g}] "
                  f"({s['samples']} samples at T={s['temperature']}): mean solve rate {s['mean_solve_rate']:.1%} "
                  f"(pool {s['pool_solve_rate']:.1%}); wrote {out / 'tasks.jsonl'}", highlight=False)


# --- filter (the three-rerun determinism filter) ----------------------------------------------
filter_app = typer.Typer(help="The three-rerun determinism filter: admit only tasks whose held-out tests "
                              "give the same outcomes in fresh, differently seeded sandboxes.")
app.add_typer(filter_app, name="filter-tasks")


def _filter_progress():
    """A Rich progress bar and the (on_start, on_result) callbacks that drive it."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                               TimeElapsedColumn)

    class TasksPerMinute(ProgressColumn):
        def render(self, task):
            return Text(f"{task.speed * 60:.1f} tasks/min" if task.speed else "", style="progress.data.speed")

    progress = Progress(TextColumn("filter"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[admitted]} admitted, {task.fields[discarded]} discarded, "
                                   "{task.fields[infra_error]} infra"),
                        TasksPerMinute(), TimeElapsedColumn(), console=err_console)
    ids: list = []

    def on_start(total: int, done: int) -> None:
        ids.append(progress.add_task("filter", total=total, completed=done, admitted=0, discarded=0,
                                     infra_error=0))

    def on_result(record: dict) -> None:
        verdict = record["verdict"]
        progress.update(ids[0], advance=1, **{verdict: progress.tasks[0].fields[verdict] + 1})

    return progress, on_start, on_result


@filter_app.callback(invoke_without_command=True)
@long_command
def filter_tasks_command(
    ctx: typer.Context,
    tasks: str | None = typer.Option(None, "--tasks", help="Task file (JSONL), directory or dataset."),
    engine: str | None = typer.Option(None, "--engine", help="Fork engine: local (default) or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay."),
    reruns: int | None = typer.Option(None, "--reruns", help="Gold-patch reruns per task (default 3)."),
    workers: int = typer.Option(2, "--workers", help="Tasks checked in parallel."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where run directories go (or a filter "
                             "run directory to resume)."),
    resume: Path | None = typer.Option(None, "--resume", help="Resume this filter-tasks run directory."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N tasks."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the reruns' hash seeds and test orders "
                                    "(default 0)."),
    timeout: float | None = typer.Option(None, "--timeout", help="Seconds per test run (default 1800)."),
    record_http: bool = typer.Option(False, "--record-http", help="First run each task with an environment "
                                     "once with the gold patch and network, recording its HTTP traffic; "
                                     "every other run replays it with no network."),
) -> None:
    """Filter a task set: pre-check, then the gold patch rerun --reruns times per task; writes
    admitted.jsonl, discarded.jsonl, infra_errors.jsonl and the discard table into a run directory."""
    if ctx.invoked_subcommand is not None:
        return
    from crr.filter import filter_config, filter_tasks, open_run

    run, settings, candidates = open_run({"tasks": tasks, "engine": engine, "mode": mode, "reruns": reruns,
                                          "limit": limit, "seed": seed, "timeout": timeout,
                                          "record_http": record_http or None}, out, resume)
    err_console.print(f"run directory: {run.path}", highlight=False, soft_wrap=True)
    _resume_with(f"crr filter-tasks --resume {shlex.quote(str(run.path))}")
    progress, on_start, on_result = _filter_progress()
    with progress:
        summary = filter_tasks(candidates, run, filter_config(settings), workers=workers,
                               on_start=on_start, on_result=on_result)
    console.print((run.path / "discard_table.md").read_text(), highlight=False, markup=False, soft_wrap=True)
    console.print(summary.line(), highlight=False, soft_wrap=True)
    console.print(f"admitted tasks: {run.path / 'admitted.jsonl'}", highlight=False, soft_wrap=True)


@filter_app.command("bench")
@friendly
def filter_bench_command(
    n: int = typer.Option(40, "--n", help="Micro tasks to generate."),
    flaky_rate: float = typer.Option(0.25, "--flaky-rate", help="Fraction of tasks with a planted flaky "
                                     "test."),
    seed: int = typer.Option(0, "--seed", help="Seed of the micro tasks and of the filter."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay."),
    reruns: int = typer.Option(3, "--reruns", help="Gold-patch reruns per task."),
    workers: int = typer.Option(2, "--workers", help="Tasks checked in parallel."),
    split: str = typer.Option("train", "--split", help="Micro split: train or test."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where the bench's run directory goes."),
    as_json: bool = typer.Option(False, "--json", help="Print the score as JSON."),
) -> None:
    """Score the filter on micro tasks with planted flaky tests: recall of flaky tasks, false
    discards of deterministic ones, infra errors, tasks/min."""
    from rich.table import Table

    from crr.filter.bench import filter_bench

    progress, on_start, on_result = _filter_progress()
    err_console.print(f"generating {n} micro tasks (flaky rate {flaky_rate}), then filtering them",
                      highlight=False)
    with progress:
        result = filter_bench(n, flaky_rate, seed, engine=engine, mode=mode, reruns=reruns, workers=workers,
                              out=out, split=split, on_start=on_start, on_result=on_result)
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"crr filter-tasks bench: {engine} engine, n={n}, flaky rate {flaky_rate}, "
                        f"{reruns} reruns, {workers} workers")
    for col in ("flaky kind", "tasks", "discarded", "recall", "missed"):
        table.add_column(col)
    for kind, k in result["per_kind"].items():
        table.add_row(kind, str(k["tasks"]), str(k["discarded"]), f"{k['recall']:.2f}",
                      ", ".join(k["missed"]))
    console.print(table)
    recall = "n/a" if result["recall"] is None else f"{result['recall']:.3f}"
    speed = "n/a" if result["tasks_per_min"] is None else f"{result['tasks_per_min']:.1f}"
    console.print(f"recall {recall} ({result['flaky_discarded']}/{result['flaky_tasks']} flaky tasks "
                  f"discarded; caught by {result['caught_by']}), false discards {result['false_discards']}/"
                  f"{result['deterministic_tasks']} deterministic tasks, infra errors "
                  f"{result['infra_errors']}, {speed} tasks/min", highlight=False, soft_wrap=True)
    console.print(f"run directory: {result['run_dir']}", highlight=False, soft_wrap=True)


# --- sandbox ----------------------------------------------------------------------------------
sandbox_app = typer.Typer(help="Sandboxes: clean up what crashed runs left behind.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("gc")
@friendly
def sandbox_gc(
    all_: bool = typer.Option(False, "--all", help="Also remove the per-task image and /testbed caches."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
) -> None:
    """Remove the containers, snapshot images, mounts and directories of crashed crr runs (only
    crr's, only those whose owning process is gone)."""
    from crr.errors import SandboxError
    from crr.replay import docker as docker_engine
    from crr.replay.local import gc_leftovers

    verb = "would remove" if dry_run else "removed"
    try:
        removed = docker_engine.gc(all=all_, dry_run=dry_run)
        console.print(f"docker: {verb} {len(removed)}", highlight=False)
        for item in removed:
            console.print(f"  {item}", highlight=False)
    except SandboxError as e:
        console.print(f"docker: skipped ({e})", highlight=False)
    if dry_run:  # gc_leftovers has no dry run
        console.print("local: skipped (no dry run for local engine leftovers)", highlight=False)
        return
    removed = gc_leftovers()
    console.print(f"local: {verb} {len(removed)}", highlight=False)
    for item in removed:
        console.print(f"  {item}", highlight=False)


@model_app.command("bench")
@friendly
def model_bench(
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the tiny default)."),
    batch: int = typer.Option(8, "--batch", help="Calls sampled together (G)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.6, "--temperature"),
    repeats: int = typer.Option(3, "--repeats", help="Timed batches."),
    max_value_chars: int | None = typer.Option(None, "--max-value-chars"),
    threads: int | None = typer.Option(None, "--threads", help="torch intra-op threads (default: torch's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time grammar-constrained generation on the paper's prompt: tokens/s and grammar rejection rate."""
    from crr.policy.bench import generation_bench
    from crr.policy.model import default_model_dir

    if batch < 1 or repeats < 1:
        raise CRRError("--batch and --repeats must be at least 1")
    with err_console.status("generation bench"):
        result = generation_bench(model or str(default_model_dir()), batch=batch, max_new_tokens=max_new_tokens,
                                  temperature=temperature, repeats=repeats, max_value_chars=max_value_chars,
                                  threads=threads)
    if as_json:
        emit_json(result)
        return
    console.print(f"{result['model']}: batch {batch}, prompt {result['prompt_tokens']} tokens, T={temperature:g}, "
                  f"{result['threads']} thread(s): [bold]{result['tokens_per_s']:.0f} tokens/s[/] "
                  f"({result['generated_tokens']} tokens in {result['seconds']:.1f} s); grammar rejection rate "
                  f"{result['grammar_rejection_rate']:.1%}; truncated {result['truncated_rate']:.0%}; "
                  f"mean H_t {result['mean_step_entropy']:.2f}", highlight=False)


@model_app.command("probe")
@friendly
def model_probe(
    model: str | None = typer.Option(None, "--model", help="Model or LoRA adapter directory, or hub id (default: "
                                     "the warm-started default if built, else the tiny default)."),
    tasks: str = typer.Option("micro-test", "--tasks", help="Task file (JSONL), directory, micro set or dataset."),
    n_tasks: int = typer.Option(16, "--n-tasks", help="Expert episodes on the first N tasks."),
    seed: int = typer.Option(0, "--seed", help="The expert's seed."),
    engine: str = typer.Option("local", "--engine", help="Fork engine for the expert's episodes: local or docker."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Where a policy departs from the exploring expert: teacher-forced loss and argmax accuracy of its
    action tokens on the expert's solved episodes, per part of the call (the tool, then each argument:
    path, line numbers, replacement, command, test filter); grammar-forced structure left out. A call is
    right only when every token of it is, so a part far below 100% caps the pass rate."""
    from rich.table import Table

    from crr.eval.evaluate import load_eval_policy, resolve_policy
    from crr.policy.model import agent_record
    from crr.policy.sft import ExpertDataSettings, action_field_stats, build_sft_dataset
    from crr.replay import get_engine
    from crr.tasks.loaders import load_tasks

    if n_tasks < 1:
        raise CRRError(f"--n-tasks must be at least 1, got {n_tasks}")
    policy = resolve_policy(model)
    policy_model, tokenizer = load_eval_policy(policy)
    task_list = load_tasks(tasks)[:n_tasks]
    record = agent_record(policy.model, policy.base_model)  # the episodes as this model was trained to see them
    settings = ExpertDataSettings(**{k: record[k] for k in ("agent_format", "max_turns") if k in record})
    with err_console.status(f"expert episodes on {len(task_list)} tasks"), get_engine(engine) as fork_engine:
        rows = build_sft_dataset(task_list, fork_engine, seed, tokenizer, settings)
    with err_console.status(f"scoring {len(rows)} expert episodes"):
        stats = action_field_stats(policy_model, tokenizer, rows)
    result = {"model": policy.model, "tasks": tasks, "episodes": len(rows), "parts": stats}
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"{policy.model} on the expert's {len(rows)} solved episodes of {tasks} (semantic action tokens)")
    for col in ("part", "tokens", "loss (nats)", "argmax accuracy"):
        table.add_column(col, justify="left" if col == "part" else "right")
    for part, r in stats.items():
        table.add_row(part, str(r["tokens"]), f"{r['nll']:.2f}", f"{r['accuracy']:.1%}")
    console.print(table)


# --- report (the paper's tables and figures from run directories) and experiment (comparison driver)
report_app = typer.Typer(help="The paper's tables and figures from run directories only.", no_args_is_help=True)
app.add_typer(report_app, name="report")
_RUNS_HELP = "A run directory or a folder holding run directories (searched recursively); repeatable."


def _print_report(kind: str, out: Path, runs, entries) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"crr report {kind}: {len(runs.train)} train runs, {len(runs.evals)} eval runs "
                        f"({runs.scale} scale) -> {out}")
    for col in ("output", "status", "written"):
        table.add_column(col)
    style = {"complete": "green", "partial": "yellow", "missing": "red"}
    for e in entries:
        table.add_row(e.name, f"[{style[e.status]}]{e.status}[/]", " ".join(Path(f).suffix[1:] for f in e.files) or "-")
    console.print(table)
    todo = {m["what"]: m["commands"] for e in entries for m in e.missing}
    if todo:
        console.print(f"[bold]{len(todo)} runs missing[/] (listed with their commands in {out / 'report.md'}):")
        for what, commands in todo.items():
            console.print(f"  {escape(what)}:", highlight=False)
            for c in commands:
                console.print(f"    {escape(c)}", highlight=False, soft_wrap=True)
    console.print(f"index: {out / 'report.md'}", highlight=False)


@report_app.command("tables")
@friendly
def report_tables(
    runs: list[Path] = typer.Option(..., "--runs", help=_RUNS_HELP),
    out: Path = typer.Option(Path("results/report"), "--out", help="Where the tables and report.md go."),
) -> None:
    """Main results, composition, Search-Select, accounting ledger, equal wall clock, the four ablations, advantage
    SNR and covariance, pass@k and all-n, error taxonomy (shares and absolute rates), per-repository pass@1 and
    the fork composition, each as Markdown, LaTeX (booktabs) and CSV. A table whose runs are missing says which
    runs to make, with the commands."""
    from crr.report import write_tables

    loaded, entries = write_tables(runs, out)
    _print_report("tables", out, loaded, entries)


@report_app.command("plots")
@friendly
def report_plots(
    runs: list[Path] = typer.Option(..., "--runs", help=_RUNS_HELP),
    out: Path = typer.Option(Path("results/report"), "--out", help="Where the figures and report.md go."),
) -> None:
    """Sample efficiency (pass@1 against on-policy trajectories and wall clock), training reward, the ablation
    panels (k, selector, horizon, T_cf), advantage SNR and covariance, per-repository pass@1; PNG and PDF."""
    from crr.report import write_plots

    loaded, entries = write_plots(runs, out)
    _print_report("plots", out, loaded, entries)


experiment_app = typer.Typer(help="Run a whole comparison (experiments/*.comparison.yaml): train every arm and "
                                  "seed, evaluate, report.", no_args_is_help=True)
app.add_typer(experiment_app, name="experiment")


@experiment_app.command("run")
@long_command
def experiment_run(
    spec: Path = typer.Argument(..., help="A comparison spec, e.g. experiments/cpu-main.comparison.yaml."),
    out: Path | None = typer.Option(None, "--out", help="Where runs/, evals/ and report/ go (default: "
                                    "results/NAME, NAME from the spec)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show each train run's state and command; run nothing."),
    report: bool = typer.Option(True, "--report/--no-report", help="Write the tables and figures at the end."),
) -> None:
    """Train every arm and seed of the spec (skipping finished runs, resuming interrupted ones), evaluate each
    final model and the checkpoints the spec names, then write `crr report` tables and figures to OUT/report."""
    from crr.comparison import plan, run_comparison
    from crr.experiments import load_comparison

    comparison = load_comparison(spec)
    out = out or Path("results") / comparison.name
    if dry_run:
        console.print(f"[bold]{comparison.name}[/]: {len(comparison.arms)} arms -> {out}", highlight=False)
        for s in plan(comparison, out):
            console.print(f"  {s.arm} seed {s.seed} [{s.status}] {s.command or s.path}", highlight=False,
                          soft_wrap=True, markup=False)
        console.print("each finished run RUN of arm ARM is then evaluated:", highlight=False)
        for e in comparison.evals:
            at = ", ".join(f"{f:.0%}" for f in e.checkpoint_fractions)
            console.print(f"  {e.command('RUN', out=out / 'evals' / 'ARM')}" + (f" (also at the checkpoints nearest "
                          f"{at} of its wall clock: --checkpoint N)" if at else ""), highlight=False, soft_wrap=True,
                          markup=False)
        return
    _resume_with(_same_command())  # finished runs are skipped, interrupted ones resumed
    statuses = run_comparison(comparison, out, report=report,
                              say=lambda m: console.print(m, highlight=False, soft_wrap=True))
    if statuses:
        console.print(", ".join(f"{k}: {v}" for k, v in statuses.items()), highlight=False, soft_wrap=True)


# --- demo (the main job until the trainer lands) ----------------------------------------------
@app.command()
@friendly
def demo(
    engine: str = typer.Option("local", help="Fork engine: local (overlayfs) or docker."),
    mode: str = typer.Option("commit", help="Docker fork mode: commit or overlay."),
    seed: int = typer.Option(0, help="Seed of the generated micro task."),
    out: Path = typer.Option(Path("results/runs"), help="Where the run directory goes."),
) -> None:
    """The environment demo: a scripted expert solves a generated micro task through the five tools;
    the sandbox is forked at two decision points, an alternative action is rolled forward in each
    fork, and the verifier scores both branches: A_t = R(tau) - R(tau~_t)."""
    from rich.table import Table

    from crr.demo import run_demo
    from crr.replay import get_engine
    from crr.rundir import RunDir
    from crr.tasks.micro import generate_micro

    run = RunDir.create("demo", f"seed{seed}", root=out, config={"engine": engine, "mode": mode, "seed": seed},
                        seeds={"task": seed})
    with console.status("generating a micro task (its FAIL_TO_PASS/PASS_TO_PASS come from real pytest runs)"):
        task = generate_micro(run.path / "tasks", n=1, seed=seed, split="train")[0]
    console.print(f"[bold]task[/] {task.instance_id}: {task.problem_statement.splitlines()[0]}")
    opts = {"mode": mode} if engine == "docker" else {}
    fork_engine = get_engine(engine, **opts)
    try:
        with console.status(f"episode and forks on the {engine} engine"):
            result = run_demo(task, fork_engine, run)
    finally:
        fork_engine.close()

    def short(call: dict) -> str:
        args = call["arguments"]
        main = args.get("path") or args.get("command") or args.get("test_filter") or ""
        lines = f":{args['start']}-{args['end']}" if "start" in args and "end" in args else ""
        return f"{call['name']}({main}{lines})"

    steps = Table(title=f"realised trajectory tau  (R = {result.reward:g})")
    for col in ("t", "action", "type", "observation"):
        steps.add_column(col)
    for s in result.steps:
        steps.add_row(str(s.t), short(s.call), "-" if s.tool_type is None else f"{s.tool_type:g}",
                      s.observation.strip().splitlines()[0][:60] if s.observation.strip() else "")
    console.print(steps)
    forks = Table(title="counterfactual forks: A_t = R(tau) - R(tau~_t)")
    for col in ("t", "a_t", "a~_t", "R(tau)", "R(tau~)", "A_t", "snap ms", "restore ms"):
        forks.add_column(col)
    for f in result.forks:
        fmt = lambda v: "infra" if v is None else f"{v:g}"  # noqa: E731
        forks.add_row(str(f.t), short(f.realised), short(f.counterfactual),
                      fmt(f.r_realised), fmt(f.r_counterfactual), fmt(f.advantage),
                      f"{f.snapshot_ms:.1f}", f"{f.restore_ms:.1f}")
    console.print(forks)
    console.print(f"run directory: {run.path}")


# --- rollout (the rollout engine: G trajectories per task, transcripts, fork bench) ------------
rollout_app = typer.Typer(help="Roll out a policy: G trajectories per task in sandboxes, with transcripts "
                               "and the pass rate; `crr rollout bench` times throughput and forking.")
app.add_typer(rollout_app, name="rollout")


@rollout_app.callback(invoke_without_command=True)
@long_command
def rollout_command(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the shipped "
                                     "warm-started default)."),
    tasks: str = typer.Option("micro-test", "--tasks", help="Task file (JSONL), directory, micro set or dataset."),
    n: int = typer.Option(1, "--n", help="Tasks to roll out (the first N)."),
    group: int = typer.Option(8, "--group", help="G: trajectories per task."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay."),
    temperature: float = typer.Option(0.6, "--temperature", help="0.6 the paper's rollouts; 0 greedy."),
    seed: int = typer.Option(0, "--seed", help="Drives every sampling seed."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="H: the turn cap (default: the model's "
                                         "recorded H, else 50)."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Token budget of one tool call."),
    agent_format: str | None = typer.Option(None, "--agent-format", help="paper or compact (default: the "
                                            "format the model was trained with, else paper)."),
    max_value_chars: int | None = typer.Option(None, "--max-value-chars", help="Bound every string argument "
                                               "(complete calls from untrained models; slower masks)."),
    time_limit: float = typer.Option(3600.0, "--time-limit", help="Seconds per trajectory (wall clock)."),
    workers: int = typer.Option(4, "--workers", help="Concurrent tool executions."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where the run directory goes."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Run the policy on N tasks, G trajectories each; print each transcript (call, H_t, tool type, a
    short observation) and the pass rate. Trajectories go to trajectories.jsonl in a run directory."""
    if ctx.invoked_subcommand is not None:
        return
    import dataclasses

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from crr.agent.episode import EpisodeConfig
    from crr.policy.backend import TransformersBackend
    from crr.policy.model import agent_record, default_policy_dir, load_policy
    from crr.replay import get_engine
    from crr.rollout import TRAJECTORIES_FILE, RolloutConfig, rollout
    from crr.rundir import RunDir
    from crr.tasks.loaders import load_tasks

    if n < 1:
        raise CRRError(f"--n must be at least 1, got {n}")
    task_list = load_tasks(tasks)[:n]
    if model is None:
        with err_console.status("loading the default model (the random tiny one is built on first use)"):
            model = str(default_policy_dir())
    policy, tokenizer = load_policy(model)
    record = agent_record(model)
    # Nothing forks here, so no snapshots; the trainer keeps them.
    config = RolloutConfig(group=group, seed=seed, workers=workers, episode=EpisodeConfig(
        agent_format=agent_format or record.get("agent_format", "paper"),
        max_turns=max_turns or record.get("max_turns", 50), temperature=temperature, max_new_tokens=max_new_tokens, time_limit_s=time_limit,
        max_context_tokens=getattr(policy.config, "max_position_embeddings", None), snapshots=False))
    backend = TransformersBackend(policy, tokenizer, max_value_chars=max_value_chars)
    run = RunDir.create("rollout", f"n{n}-g{group}-seed{seed}", root=out, seeds={"rollout": seed},
                        config={"model": model, "tasks": tasks, "n": n, "engine": engine, "mode": mode,
                                "max_value_chars": max_value_chars, **dataclasses.asdict(config)})
    err_console.print(f"run directory: {run.path}", highlight=False)
    progress = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console)
    bar = progress.add_task("rollout", total=len(task_list) * group)
    fork_engine = get_engine(engine, **({"mode": mode} if mode else {}))
    try:
        with progress:
            result = rollout(task_list, backend, fork_engine, tokenizer, config, run=run,
                             on_trajectory=lambda _: progress.advance(bar))
    finally:
        fork_engine.close()
    summary = {**result.summary, "run_dir": str(run.path)}
    if as_json:  # token ids and log-probabilities are in trajectories.jsonl
        emit_json({"summary": summary, "trajectories": [
            {**{k: v for k, v in t.to_dict().items() if k not in ("steps", "messages", "prompt_ids")},
             "steps": [{k: getattr(s, k) for k in ("t", "action", "call", "parse_error", "observation", "is_error",
                                                    "entropy", "tool_type", "grammar_rejections", "truncated")}
                       for s in t.steps]} for t in result.trajectories]})
        return

    def reward(t) -> str:
        return f"[yellow]infra: {t.infra_error}[/]" if t.reward is None else f"R = {t.reward:g}"

    for t in result.trajectories:
        table = Table(title=f"{t.task_id} #{t.group}: {reward(t)}, {t.end_reason} after {len(t.steps)} turns",
                      title_justify="left")
        for col, justify in (("t", "right"), ("call", "left"), ("H_t", "right"), ("type", "right"),
                             ("observation", "left")):
            table.add_column(col, justify=justify, overflow="fold" if col == "call" else "ellipsis")
        for s in t.steps:
            obs = next((line for line in s.observation.splitlines() if line.strip()), "")[:70]
            table.add_row(str(s.t), Text(s.action[:100] + ("..." if len(s.action) > 100 else "")),
                          f"{s.entropy:.2f}", "-" if s.tool_type is None else f"{s.tool_type:g}",
                          Text(obs, style="red" if s.is_error else ""))
        console.print(table)
    rate = "n/a" if summary["pass_rate"] is None else f"{summary['pass_rate']:.1%}"
    console.print(f"pass rate [bold]{rate}[/] ({summary['passed']}/{summary['scored']} scored; "
                  f"{summary['infra_errors']} infra errors excluded); {summary['steps']} turns, "
                  f"{summary['generated_tokens']} generated tokens ({summary['generated_tokens_per_s'] or 0:.1f}/s), "
                  f"{summary['trajectories_per_min']:.2f} trajectories/min", highlight=False, soft_wrap=True)
    console.print(f"trajectories: {run.path / TRAJECTORIES_FILE}", highlight=False)


@rollout_app.command("bench")
@friendly
def rollout_bench_command(
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id (default: the tiny default)."),
    group: int = typer.Option(8, "--group", help="G: trajectories of the one micro task."),
    max_turns: int = typer.Option(4, "--max-turns", help="Turn cap of the throughput run."),
    max_new_tokens: int = typer.Option(96, "--max-new-tokens"),
    max_value_chars: int = typer.Option(16, "--max-value-chars", help="Bound every string argument to this many "
                                        "characters (the untrained default model rambles); 0: unbounded, as a "
                                        "trained policy runs."),
    engine: str = typer.Option("local", "--engine", help="Fork engine: local or docker."),
    mode: str | None = typer.Option(None, "--mode", help="Docker engine mode: commit or overlay (fork bench)."),
    fork_steps: int = typer.Option(45, "--fork-steps", help="Length of the scripted trajectory forked."),
    repeats: int = typer.Option(5, "--repeats", help="Timed forks per index and strategy."),
    only: str | None = typer.Option(None, "--only", help="throughput or fork (default: both)."),
    threads: int | None = typer.Option(None, "--threads", help="torch intra-op threads (default: torch's)."),
    prefix_cache: str = typer.Option("on", "--prefix-cache", help="Throughput with prefix KV reuse across turns "
                                     "(on), without (off), or both in one run (both: prints the speed-up)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Rollout throughput (generated tokens/s, trajectories/min at G) and fork-by-index latency at t=5
    and t=40: restore of the per-step snapshot vs replay of the prefix verified by tree digest."""
    from rich.table import Table

    from crr.rollout_bench import fork_bench, throughput_bench

    if only not in (None, "throughput", "fork"):
        raise CRRError(f"--only takes throughput or fork, got {only!r}")
    if prefix_cache not in ("on", "off", "both"):
        raise CRRError(f"--prefix-cache takes on, off or both, got {prefix_cache!r}")
    result: dict = {}
    if only in (None, "fork"):
        with err_console.status(f"fork bench: a {fork_steps}-step scripted trajectory on the {engine} engine"):
            result["fork"] = fork_bench(engine, steps=fork_steps, repeats=repeats, **({"mode": mode} if mode else {}))
    if only in (None, "throughput"):
        for reuse in {"on": [True], "off": [False], "both": [False, True]}[prefix_cache]:
            with err_console.status(f"throughput bench: G={group}, {max_turns}-turn cap, prefix cache "
                                    f"{'on' if reuse else 'off'}"):
                result["throughput" if reuse else "throughput_no_prefix_cache"] = throughput_bench(
                    model, group=group, max_turns=max_turns, max_new_tokens=max_new_tokens,
                    max_value_chars=max_value_chars or None, engine=engine, threads=threads, prefix_cache=reuse)
    if as_json:
        emit_json(result)
        return
    if "fork" in result:
        f = result["fork"]
        table = Table(title=f"fork by step index, {f['engine']} engine, {f['steps']}-step trajectory of {f['task']} "
                            f"(median of {f['repeats']}, ms)")
        for col in ("t", "restore snapshot", "+ first command", "replay + verify", "restore exact"):
            table.add_column(col, justify="right")
        for t, r in f["at"].items():
            table.add_row(str(t), f"{r['restore_ms_p50']:.1f}", f"{r['ready_ms_p50']:.1f}", f"{r['replay_ms_p50']:.0f}",
                          "[green]yes[/]" if r["restore_exact"] else "[red]NO[/]")
        console.print(table)
        console.print(f"per-step recording cost: snapshot {f['snapshot_ms_p50']:.1f} ms, tree digest "
                      f"{f['digest_ms_p50']:.0f} ms", highlight=False)
    for key in ("throughput_no_prefix_cache", "throughput"):
        if key not in result:
            continue
        r = result[key]
        reuse = (f"prefix cache on: {r['prompt_tokens_reused']} prompt tokens reused, {r['prompt_tokens_prefilled']} "
                 "encoded" if r["prefix_cache"] else "prefix cache off")
        console.print(f"throughput ({reuse}): G={r['group']}, {r['max_turns']}-turn cap, {r['steps']} turns, "
                      f"{r['threads']} torch thread(s): "
                      f"[bold]{r['generated_tokens_per_s']:.1f} generated tokens/s[/] ({r['generated_tokens']} in "
                      f"{r['generation_s']:.0f} s of generation), [bold]{r['trajectories_per_min']:.2f} "
                      f"trajectories/min[/] ({r['wall_s']:.0f} s wall)", highlight=False, soft_wrap=True)
    if "throughput" in result and "throughput_no_prefix_cache" in result:
        on, off = result["throughput"], result["throughput_no_prefix_cache"]
        console.print(f"prefix reuse speed-up: generation time x{off['generation_s'] / on['generation_s']:.2f}, "
                      f"trajectories/min x{on['trajectories_per_min'] / off['trajectories_per_min']:.2f}",
                      highlight=False)


# --- sft (the warm start: exploring-expert trajectories, TRL's SFTTrainer) ---------------------
# The default recipe, crr.policy.sft.SFTRecipe() (tests/test_sft.py keeps them equal); spelled out here so
# that the CLI starts without importing torch.
_SFT_DEFAULTS = {"tasks": "micro-train", "n_tasks": 160, "episodes": 1, "error_rate": 0.3, "epochs": 2.0,
                 "lr": 1e-3, "bf16": False}


@app.command("sft")
@long_command
def sft_command(
    model: str | None = typer.Option(None, "--model", help="Model directory or hub id to warm-start (default: "
                                     "the tiny default, built on first use; the result then becomes the cached "
                                     "warm-started default when the recipe is the default one)."),
    tasks: str = typer.Option(_SFT_DEFAULTS["tasks"], "--tasks",
                              help="Task file (JSONL), directory, micro set or dataset."),
    n_tasks: int | None = typer.Option(_SFT_DEFAULTS["n_tasks"], "--n-tasks", help="Use the first N tasks (micro-train is generated "
                                       "that large if N exceeds its default 32)."),
    episodes: int = typer.Option(_SFT_DEFAULTS["episodes"], "--episodes", help="Expert episodes per task."),
    error_rate: float = typer.Option(_SFT_DEFAULTS["error_rate"], "--error-rate",
                                     help="Chance the expert makes a wrong edit first."),
    epochs: float = typer.Option(_SFT_DEFAULTS["epochs"], "--epochs", help="SFT epochs."),
    lr: float = typer.Option(_SFT_DEFAULTS["lr"], "--lr", help="Peak learning rate (cosine schedule)."),
    bf16: bool = typer.Option(_SFT_DEFAULTS["bf16"], "--bf16/--fp32", help="bf16 autocast (faster on CPUs with "
                              "AVX512-BF16 and on GPUs; deterministic, but not bit-equal to fp32)."),
    seed: int = typer.Option(0, "--seed", help="Drives the expert's episodes and the trainer."),
    engine: str = typer.Option("local", "--engine", help="Fork engine for the expert's sandboxes: local or docker."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where the run directory goes."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue an interrupted `crr sft` run directory "
                                       "(its config, expert data and latest checkpoint)."),
    recipe_file: Path | None = typer.Option(None, "--recipe", help="A recipe YAML (crr.policy.sft.SFTRecipe's "
                                            "fields, e.g. experiments/sft-nano.yaml, the shipped default's); "
                                            "replaces the recipe options above."),
    data_only: bool = typer.Option(False, "--data-only", help="Stop after the expert data; prints how to train "
                                   "on it elsewhere (python -m crr.policy.sft_trainer, e.g. on a GPU node)."),
) -> None:
    """Warm-start a policy with supervised fine-tuning on scripted expert trajectories: the expert explores
    (views decoys, reproduces the issue, sometimes errs and corrects itself), every episode is played in a
    real sandbox and kept only if the verifier gives it reward 1; TRL's SFTTrainer then trains on the tool
    calls (observations masked). Writes a run directory with the config, expert.jsonl, the loss curve in
    metrics.jsonl and the model in model/."""
    from dataclasses import asdict, replace

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from crr.agent.expert import ExpertConfig
    from crr.policy.model import default_model_dir, default_sft_model_dir
    from crr.policy.sft import ExpertDataSettings, SFTRecipe, SFTSettings, install_default, warm_start
    from crr.rundir import RunDir

    if resume is not None:
        run = RunDir.open(resume, write=True)
        recipe, model = SFTRecipe.from_dict(run.config["recipe"]), run.config["model"]
    else:
        if recipe_file is not None:
            recipe = SFTRecipe.from_yaml(recipe_file)
        else:
            recipe = SFTRecipe(tasks=tasks, n_tasks=n_tasks, seed=seed, engine=engine,
                               data=ExpertDataSettings(episodes_per_task=episodes,
                                                       expert=ExpertConfig(error_rate=error_rate)),
                               train=SFTSettings(epochs=epochs, learning_rate=lr, bf16=bf16))
        if model is None:
            with err_console.status("loading the default tiny model (built on first use)"):
                model = str(default_model_dir())
        run = RunDir.create("sft", f"{Path(recipe.tasks).name}-seed{recipe.seed}", root=out, seeds={"sft": recipe.seed},
                            config={"model": model, "recipe": asdict(recipe)})
    err_console.print(f"run directory: {run.path}", highlight=False)
    _resume_with(f"crr sft --resume {shlex.quote(str(run.path))}")
    kept = {"n": 0}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[note]}"), console=err_console)
    bars = {"expert": progress.add_task("expert episodes", total=None, note="", visible=False),
            "train": progress.add_task("SFT steps", total=None, note="", start=False)}

    def report(stage: str, done: int, total: int, record: dict) -> None:
        if stage == "expert":
            kept["n"] += record["kept"]
            progress.update(bars["expert"], completed=done, total=total, note=f"kept {kept['n']}", visible=True)
            return
        progress.start_task(bars["train"])  # no-op once started: its clock counts training only
        if total > 0:
            progress.update(bars["train"], completed=done, total=total)
        else:
            progress.update(bars["train"], note=f"loss {record['loss']:.3f}")

    with progress:
        model_out = warm_start(model, recipe, run, report, data_only=data_only)
    summary = json.loads((run.path / "expert_summary.json").read_text()) if (run.path / "expert_summary.json").is_file() else None
    losses = [r["loss"] for r in run.records("metrics.jsonl") if r.get("event") == "sft" and "loss" in r]
    if summary:
        console.print(f"expert: kept [bold]{summary['kept']}/{summary['episodes']}[/] episodes "
                      f"({summary['kept_fraction']:.0%} with reward 1), {summary['with_wrong_edit']} with a corrected "
                      f"wrong edit, {summary['mean_steps']:.1f} steps and {summary['mean_tokens']:.0f} tokens on average",
                      highlight=False)
    if data_only:
        settings = json.dumps(asdict(replace(recipe.train, seed=recipe.seed)))
        console.print(f"expert data: {model_out}\ntrain on it with: python -m crr.policy.sft_trainer {model} OUT_DIR "
                      f"{model_out} --agent {recipe.data.agent_format}:{recipe.data.max_turns} "
                      f"--settings '{settings}'", highlight=False, soft_wrap=True)
        return
    if losses:
        console.print(f"SFT: {len(losses)} steps, loss {losses[0]:.3f} -> [bold]{losses[-1]:.3f}[/]", highlight=False)
    console.print(f"model: {model_out}", highlight=False)
    if model == str(default_model_dir()) and recipe == SFTRecipe():
        target = install_default(model_out, default_sft_model_dir(build=False))
        console.print(f"cached as the warm-started default: {target}", highlight=False)


# --- train (the CRR trainer on TRL: grpo, crr, search-select) and replay verify -----------------
@app.command("train")
@long_command
def train_command(
    overrides: list[str] = typer.Argument(None, help="Config overrides key=value (e.g. k=2 crr.cf_temperature=0.5)."),
    method: str | None = typer.Option(None, "--method", help="grpo | crr | search-select (default: the config's)."),
    config: Path | None = typer.Option(None, "--config", help="A preset YAML (default: experiments/cpu-crr.yaml)."),
    seed: int | None = typer.Option(None, "--seed", help="Drives rollouts, selector, proposals and the learner."),
    out: Path = typer.Option(Path("results/runs"), "--out", help="Where the run directory goes."),
    max_trajectories: int | None = typer.Option(None, "--max-trajectories", help="Stop after N on-policy trajectories."),
    max_updates: int | None = typer.Option(None, "--max-updates", help="Stop after N optimizer updates."),
    budget_hours: float | None = typer.Option(None, "--budget-hours", help="Stop after H hours of ledger wall clock."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue a run directory from its last checkpoint."),
    eval_tasks: str | None = typer.Option(None, "--eval", help="Held-out tasks (e.g. nano-test) on which the "
                                          "starting and the trained policy are evaluated greedily (pass@1 before "
                                          "and after, in the run's eval-before/ and eval-after/)."),
    eval_n: int | None = typer.Option(None, "--eval-n", help="With --eval: the first N tasks (default all)."),
) -> None:
    """Train with GRPO, CRR (hybrid advantages from forked counterfactuals) or Search-Select; writes a run
    directory with config.yaml, manifest.json, metrics.jsonl, ledger.json, tuples/ and checkpoints/."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from crr.train.config import load_config, parse_overrides
    from crr.train.trainer import resolve_model, resume_run, start_run, train

    checkpoint = None
    if resume is not None:
        cfg, run, checkpoint = resume_run(resume)
    else:
        opts = {k: v for k, v in {"method": method, "seed": seed, "max_trajectories": max_trajectories,
                                  "max_steps": max_updates, "budget_hours": budget_hours}.items() if v is not None}
        cfg = load_config(config, {**parse_overrides(overrides or []), **opts, "output_dir": str(out)})
        run = start_run(cfg, out)
    err_console.print(f"run directory: {run.path}", highlight=False)
    _resume_with(f"crr train --resume {shlex.quote(str(run.path))}")
    before = after = None
    if eval_tasks is not None:
        before = _held_out_pass(eval_tasks, eval_n, cfg, run, "before", model=resolve_model(cfg))

    def line(r: dict) -> None:
        led, cum = r["ledger"], r["cumulative"]
        fmt = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
        console.print(
            f"[bold]{r['step']}/{r['max_steps']}[/] R {fmt(r['reward_mean'])} | A {fmt(r['adv_mean'], '+.3f')}"
            f"±{fmt(r['adv_std'], '.3f')} nz {fmt(r['adv_nonzero'])} | sel {r['selected']} hits {r['selector_hits']}"
            f" forks {led['forks']} contrasts {r['contrasts']}"
            + (f" replaced {r['replaced']}" if r.get("replaced") is not None else "")
            + f" | fork share {r['fork_share']:.1%} cf share {r['cf_share']:.1%} | {led['wall_s']:.1f}s (roll "
            f"{led['rollout_s']:.1f} fork {led['fork_s']:.1f} cf {led['cf_rollout_s'] + led['cf_test_s']:.1f} "
            f"upd {led['update_s']:.1f}) | "
            f"traj {cum['trajectories']} tok {cum['generated_tokens_all']}", highlight=False, soft_wrap=True)

    progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("updates"),
                        TimeElapsedColumn(), console=err_console)
    bar = progress.add_task("train", total=None)

    def update(r: dict) -> None:
        line(r)
        progress.update(bar, completed=r["step"], total=r["max_steps"])

    with progress:
        summary = train(cfg, run, checkpoint, on_iteration=update)
    c = summary["cumulative"]
    console.print(f"done: {summary['updates']} updates, {c['trajectories']} trajectories, {c['forks']} forks, "
                  f"{c['wall_s']:.0f} s; model: {summary['model']}", highlight=False, soft_wrap=True)
    rewards = [r["reward_mean"] for r in run.records("metrics.jsonl") if r.get("event") == "iteration"
               and r.get("reward_mean") is not None]
    if rewards:
        quarter = max(1, len(rewards) // 4)
        console.print("training reward per update: " + " ".join(f"{v:.2f}" for v in rewards)
                      + f"\n  mean of the first {quarter}: {sum(rewards[:quarter]) / quarter:.2f}, "
                      f"of the last {quarter}: {sum(rewards[-quarter:]) / quarter:.2f}", highlight=False, soft_wrap=True)
    if eval_tasks is not None:
        after = _held_out_pass(eval_tasks, eval_n, cfg, run, "after", run_dir=run.path)
        console.print(f"held-out pass@1 ({eval_tasks}, greedy): before [bold]{before:.1%}[/] -> after "
                      f"[bold]{after:.1%}[/]", highlight=False)


def _held_out_pass(tasks: str, n: int | None, cfg, run, when: str, model: str | None = None,
                   run_dir: Path | None = None) -> float:
    """Greedy pass@1 of the policy before or after training (a crr eval run directory inside the train run)."""
    from crr.eval.evaluate import ALIASES, BENCHMARKS, EvalConfig, benchmark, evaluate, resolve_policy, start_eval

    label, source, adapter = benchmark(tasks) if tasks in {**BENCHMARKS, **ALIASES} else benchmark("tasks", tasks)
    config = EvalConfig.make(label, source, adapter, resolve_policy(model, run_dir), n_tasks=n,
                             max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, engine=cfg.engine,
                             agent_format=cfg.agent_format, workers=cfg.workers)
    eval_run = start_eval(config, run.path / f"eval-{when}")
    with err_console.status(f"evaluating the policy {when} training on {tasks}"):
        summary = evaluate(config, eval_run)
    console.print(f"pass@1 {when} training ({label}, greedy, {summary['n_instances']} tasks): "
                  f"{summary['pass_at_1']:.1%}", highlight=False)
    return summary["pass_at_1"]


replay_app = typer.Typer(help="Replay recorded counterfactual tuples.", no_args_is_help=True)
app.add_typer(replay_app, name="replay")


@replay_app.command("verify")
@friendly
def replay_verify_command(
    run_dir: Path = typer.Argument(..., help="A `crr train` run directory with tuples/."),
    sample: int = typer.Option(10, "--sample", help="How many tuples to replay."),
    seed: int = typer.Option(0, "--seed", help="Which tuples are sampled."),
    as_json: bool = typer.Option(False, "--json", help="Print every replayed tuple as JSON."),
) -> None:
    """Re-execute sampled counterfactual suffixes from a fresh sandbox (prefix replayed) and report the
    fraction whose verifier returns reproduce."""
    from crr.train.replay_verify import replay_tuples

    result = replay_tuples(run_dir, sample, seed)
    if as_json:
        emit_json(result)
        return
    console.print(f"[bold]{result['reproduced']}/{result['sampled']}[/] replayed counterfactual returns reproduce "
                  f"({result['fraction']:.0%})", highlight=False)


# --- eval (greedy and sampled pass@k, SWE-bench predictions, the error taxonomy) ---------------
@app.command("eval")
@long_command
def eval_command(
    dataset: str | None = typer.Argument(None, help="micro (the embedded micro-test set; the default), verified, "
                                         "live, rebench, gym, or tasks."),
    file: str | None = typer.Argument(None, help="For tasks: a task file (JSONL) or directory. For verified, live, "
                                      "rebench, gym: a local copy (save_to_disk directory or .parquet) instead of "
                                      "the Hugging Face hub."),
    run_dir: Path | None = typer.Option(None, "--run", help="A `crr train` run directory: evaluates its model/ "
                                        "(or --checkpoint); LoRA adapters are applied to their base model."),
    model: str | None = typer.Option(None, "--model", help="Model or LoRA adapter directory, or hub id (default: "
                                     "the warm-started default if built, else the tiny default)."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="With --run: N for checkpoints/checkpoint-N, "
                                          "or a checkpoint directory."),
    samples: int | None = typer.Option(None, "--samples", help="n samples per instance (default 1: greedy pass@1)."),
    temperature: float | None = typer.Option(None, "--temperature", help="Default 0 (greedy) for one sample, 0.6 "
                                             "for several (the paper's sampled evaluation)."),
    seed: int | None = typer.Option(None, "--seed", help="Drives every sampling seed (default 0)."),
    n_tasks: int | None = typer.Option(None, "--n-tasks", help="Evaluate the first N tasks (default: all)."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="H: the turn cap (default 50)."),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="Token budget of one tool call "
                                              "(default 512)."),
    split: str | None = typer.Option(None, "--split", help="Dataset split (default: the dataset's usual one)."),
    engine: str | None = typer.Option(None, "--engine", help="Fork engine: local or docker (default local)."),
    workers: int | None = typer.Option(None, "--workers", help="Concurrent tool executions (default 4)."),
    batch: int | None = typer.Option(None, "--batch", help="Episodes run together, one sandbox each (default 32)."),
    out: Path = typer.Option(Path("results/evals"), "--out", help="Where the run directory goes."),
    resume: Path | None = typer.Option(None, "--resume", help="An earlier `crr eval` run directory: run only the "
                                       "samples it lacks (and its infrastructure failures)."),
    retry_infra: bool = typer.Option(True, "--retry-infra/--no-retry-infra", help="On resume, run the samples "
                                     "that met infrastructure failures again."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Evaluate a policy: greedy pass@1 with the 50-turn cap, or `--samples n` for sampled pass@1,
    pass@k (k = 1, 2, 4, 8; unbiased estimator) and all-n; per-repository pass@1 and the error taxonomy
    of failed samples. Grades in crr's sandboxes with swebench's grading; writes results.jsonl,
    SWE-bench predictions.jsonl and summary.json to a run directory (resumable)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from crr.eval.evaluate import (SAMPLED_TEMPERATURE, EvalConfig, benchmark, evaluate, load_eval_tasks,
                                   resolve_policy, resume_eval, start_eval)

    settings = {"samples": samples, "temperature": temperature, "seed": seed, "n_tasks": n_tasks,
                "max_turns": max_turns, "max_new_tokens": max_new_tokens, "split": split, "engine": engine,
                "workers": workers, "batch": batch}
    if resume is not None:
        if dataset is not None:
            settings.update(zip(("dataset", "tasks", "adapter"), benchmark(dataset, file)))
        if model is not None or run_dir is not None or checkpoint is not None:
            settings["model"] = resolve_policy(model, run_dir, checkpoint).model
        config, run = resume_eval(resume, settings)
    else:
        label, source, adapter = benchmark(dataset or "micro", file)
        with err_console.status("resolving the policy (the default model is built on first use)"):
            policy = resolve_policy(model, run_dir, checkpoint)
        n = samples or 1
        if temperature is None:
            settings["temperature"] = 0.0 if n == 1 else SAMPLED_TEMPERATURE
        config = EvalConfig.make(label, source, adapter, policy, **{k: v for k, v in settings.items() if v is not None})
        with err_console.status(f"loading the tasks of {label}"):
            load_eval_tasks(config)  # bad tasks fail here, before a run directory exists
        run = start_eval(config, out)
    err_console.print(f"run directory: {run.path}", highlight=False)
    _resume_with(f"crr eval --resume {shlex.quote(str(run.path))}")
    progress = Progress(TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[note]}"), console=err_console)
    bar = progress.add_task(config.dataset, total=None, note="")
    passed = {"n": 0, "scored": 0}

    def on_result(record: dict, done: int, total: int) -> None:
        if record["reward"] is not None:
            passed["scored"] += 1
            passed["n"] += record["reward"] == 1.0
        progress.update(bar, completed=done, total=total, note=f"passed {passed['n']}/{passed['scored']}")

    with progress:
        summary = evaluate(config, run, retry_infra=retry_infra, on_result=on_result)
    if as_json:
        emit_json({**summary, "run_dir": str(run.path)})
        return
    for table in _eval_tables(summary):
        console.print(table)
    console.print(f"results: {run.path / 'results.jsonl'}; SWE-bench predictions: {run.path / 'predictions.jsonl'}",
                  highlight=False, soft_wrap=True)


def _eval_tables(summary: dict) -> list:
    from rich.table import Table

    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    n, t = summary["samples"], summary["temperature"]
    head = Table(title=f"crr eval: {summary['dataset']}, {summary['n_instances']} instances, {summary['model']}")
    head.add_column("metric")
    head.add_column("value", justify="right")
    head.add_row(f"pass@1 ({'greedy' if t == 0 else f'sampled, T={t:g}, n={n}'})", pct(summary["pass_at_1"]))
    for k, v in summary["pass_at_k"].items():
        if k != "1":
            head.add_row(f"pass@{k}", pct(v))
    if n > 1:
        head.add_row(f"all-{n}", pct(summary["all_n"]))
    head.add_row("scored samples", str(summary["scored"]))
    head.add_row("infrastructure failures (excluded)", str(summary["infra_errors"]))
    if summary["missing"]:
        head.add_row("samples not run yet", str(summary["missing"]))
    repos = Table(title="per repository")
    for col, justify in (("repo", "left"), ("instances", "right"), ("pass@1", "right")):
        repos.add_column(col, justify=justify)
    for repo, r in summary["per_repo"].items():
        repos.add_row(repo, str(r["instances"]), pct(r["pass_at_1"]))
    modes = Table(title="error modes of failed samples")
    for col, justify in (("mode", "left"), ("count", "right"), ("share of failures", "right"),
                         ("rate (all scored)", "right")):
        modes.add_column(col, justify=justify)
    for mode, m in summary["error_modes"].items():
        modes.add_row(mode, str(m["count"]), pct(m["share"]), pct(m["rate"]))
    return [head, repos, modes]
