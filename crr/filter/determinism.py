"""The three-rerun determinism filter (paper: Appendix "Determinism Filter and Network Replay").

CRR's advantage R(realised) - R(counterfactual) is unbiased only if a sandbox forked at a step
replays deterministically, so candidate tasks whose held-out tests flake are dropped first:

  1. pre-check: a fresh sandbox with the test patch and no gold patch; the tests must behave as
     their labels say (FAIL_TO_PASS fail, PASS_TO_PASS pass: SWE-bench's definitions);
  2. reruns: the gold patch in `reruns` independent fresh sandboxes, each with its own seed, which
     sets PYTHONHASHSEED and the order the held-out ids reach the runner (crr.agent.verifier);
  3. verdict: admitted only if every FAIL_TO_PASS and PASS_TO_PASS test has the same raw status in
     every rerun (a missing test is its own status) and all of them pass.

A sandbox that fails (missing image or bundle, dead container, the verifier's infra_error) says
nothing about the task: it is an infrastructure error, neither admitted nor discarded.

Network replay (tasks with an environment, crr.sandbox.mirror / crr.sandbox.http): every sandbox
above has no network and replays HTTP from the task's cassette. With `record_http`, a recording run
comes first: the gold patch in a sandbox of a second engine that has the network (the one door),
recording every request into `cassettes/<id>.yaml` in the run directory; the admitted row points
to it. A request with no recording in any gold rerun excludes the task (`http_request_not_recorded`),
as one that makes a PASS_TO_PASS test fail in the pre-check does.

The run directory holds the append-only `results.jsonl` (one record per finished task, written as it
finishes, so a crash or Ctrl-C loses only the tasks in flight) and, rebuilt from it at the end of
every run or resume, `admitted.jsonl` (task rows for `crr train`), `discarded.jsonl`,
`infra_errors.jsonl`, `discard_table.{md,csv}` (per repository, like the paper's Table) and
`summary.json`. Each record keeps a digest of the task fields its verdict was decided on (`task_digest`), so a
resume whose task set has changed a decided task, or lost one, is refused before any sandbox starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pandas as pd

from crr.agent.tools import SCRATCH_DIR
from crr.agent.verifier import MAX_HASH_SEED, VERIFY_TIMEOUT_S, VerifierResult, verify
from crr.errors import CRRError
from crr.sandbox import EngineSpec, engine_spec_of, engine_workers
from crr.sandbox.base import ForkEngine
from crr.sandbox.http import Traffic, collect
from crr.rundir import RunDir, atomic_write_text
from crr.seeds import keyed_random
from crr.tasks.loaders import load_tasks, write_tasks
from crr.tasks.schema import Task

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
ADMITTED, DISCARDED, INFRA_ERROR = "admitted", "discarded", "infra_error"
# Why a task was discarded.
NO_FAIL_TO_PASS = "no_fail_to_pass_tests"
F2P_PASSES_BEFORE_GOLD = "fail_to_pass_passes_before_gold"
P2P_FAILS_BEFORE_GOLD = "pass_to_pass_fails_before_gold"
GOLD_DOES_NOT_APPLY = "gold_patch_does_not_apply"
NONDETERMINISTIC = "nondeterministic"
FAILS_UNDER_GOLD = "fails_under_gold"
HTTP_NOT_RECORDED = "http_request_not_recorded"
CASSETTES = "cassettes"
MAX_RERUNS = 100
DEFAULT_WORKERS = 2   # tasks checked at once, unless given (a Ray engine: its sandbox slots)


@dataclass(frozen=True)
class FilterConfig:
    """Everything that decides a verdict; stored in the run directory so a resume reuses it."""

    engine: str = "local"
    engine_options: dict = field(default_factory=dict)  # its options (crr.sandbox.engines): {"mode": "overlay"}...
    reruns: int = 3
    seed: int = 0                      # run seeds derive from (seed, instance_id)
    timeout: float = VERIFY_TIMEOUT_S  # per test run
    record_http: bool = False          # record HTTP in a gold run with network first (module doc)

    def __post_init__(self) -> None:
        if not 2 <= self.reruns <= MAX_RERUNS:
            raise CRRError(f"--reruns must be between 2 and {MAX_RERUNS} (one run cannot disagree with "
                           f"itself), got {self.reruns}")
        if not self.timeout > 0:   # (nan too)
            raise CRRError(f"--timeout must be positive, got {self.timeout}")


def run_seeds(instance_id: str, config: FilterConfig) -> list[int]:
    """[pre-check seed, rerun seeds...], all distinct and nonzero (0 turns hash randomisation off).

    The rerun seeds are consecutive from an even base, so reruns 1-2, 3-4, ... run the held-out ids
    in mirror-image orders (crr.agent.verifier.seeded_order): a dependence of one test on another
    running first cannot hide behind three shuffles that happen to agree.
    """
    rng = keyed_random("crr-filter", config.seed, instance_id)
    base = 2 * rng.randrange(1, (MAX_HASH_SEED - 2 * MAX_RERUNS) // 2)
    return [base + config.reruns, *range(base, base + config.reruns)]


# ------------------------------------------------------------------------------------ one task

def check_task(engine: ForkEngine, task: Task, config: FilterConfig, recorder: ForkEngine | None = None,
               cassettes: Path | None = None) -> dict:
    """Pre-check and reruns of one task; returns its results.jsonl record (module doc). With a
    `recorder` (an engine made with record_http=True), a task with an environment is first run
    with the gold patch there and its HTTP traffic saved under `cassettes`."""
    start = time.monotonic()
    pre_seed, *seeds = run_seeds(task.instance_id, config)
    record = {"instance_id": task.instance_id, "repo": task.repo, "task_digest": task_digest(task),
              "seeds": [pre_seed, *seeds]}

    def done(verdict: str, reason: str | None = None, detail: str = "", tests: dict | None = None) -> dict:
        return {**record, "verdict": verdict, "reason": reason, "detail": detail, "tests": tests or {},
                "seconds": round(time.monotonic() - start, 3)}

    if not task.FAIL_TO_PASS:
        return done(DISCARDED, NO_FAIL_TO_PASS, "no FAIL_TO_PASS test: no reward can tell a fix")
    try:
        if recorder is not None and task.mirror:
            recording, traffic = _run(recorder, task, pre_seed, gold=True, timeout=config.timeout, recording=True)
            if isinstance(recording, str):
                return done(DISCARDED, GOLD_DOES_NOT_APPLY, recording)
            if recording.infra_error:
                return done(INFRA_ERROR, recording.infra_error, "recording run (gold patch, with network)")
            if traffic.cassette:  # later runs replay it; the record keeps it relative to the run dir
                replay = _save_cassette(cassettes, task.instance_id, traffic.cassette)
                task = replace(task, http_replay=replay)
                record["http_replay"] = {**replay, "cassette": f"{CASSETTES}/{Path(replay['cassette']).name}"}
        pre, traffic = _run(engine, task, pre_seed, gold=False, timeout=config.timeout)
        if pre.infra_error:
            return done(INFRA_ERROR, pre.infra_error, "pre-check (no gold patch)")
        passing = {t: [pre.statuses[t]] for t in task.FAIL_TO_PASS if pre.statuses[t] == "PASSED"}
        if passing:
            return done(DISCARDED, F2P_PASSES_BEFORE_GOLD, "FAIL_TO_PASS tests pass without the gold patch",
                        passing)
        failing = {t: [pre.statuses[t]] for t in task.PASS_TO_PASS if pre.statuses[t] != "PASSED"}
        if failing and traffic.misses:
            return done(DISCARDED, HTTP_NOT_RECORDED, _misses(traffic, "the pre-check"), failing)
        if failing:
            return done(DISCARDED, P2P_FAILS_BEFORE_GOLD, pre.note or "PASS_TO_PASS tests do not pass "
                        "without the gold patch (flaky, or mislabelled)", failing)
        runs: list[VerifierResult] = []
        for seed in seeds:
            result, traffic = _run(engine, task, seed, gold=True, timeout=config.timeout)
            if isinstance(result, str):
                return done(DISCARDED, GOLD_DOES_NOT_APPLY, result)
            if result.infra_error:
                return done(INFRA_ERROR, result.infra_error, f"rerun {len(runs) + 1} (seed {seed})")
            if traffic.misses:
                return done(DISCARDED, HTTP_NOT_RECORDED, _misses(traffic, f"rerun {len(runs) + 1}"))
            runs.append(result)
    except CRRError as e:  # the sandbox could not start or died under us (SandboxError included)
        return done(INFRA_ERROR, str(e))

    outcomes = {t: [r.statuses[t] for r in runs] for t in task.held_out_tests}
    differing = {t: o for t, o in outcomes.items() if len(set(o)) > 1}
    if differing:
        return done(DISCARDED, NONDETERMINISTIC, f"{len(differing)} held-out test(s) changed outcome "
                    f"across {len(runs)} reruns", differing)
    failing = {t: o for t, o in outcomes.items() if o[0] != "PASSED"}
    notes = sorted({r.note for r in runs if r.note})
    if failing or notes:
        return done(DISCARDED, FAILS_UNDER_GOLD, "; ".join(notes) or "held-out tests fail with the gold "
                    "patch in every rerun", failing)
    return done(ADMITTED)


# A task's fields that decide its verdict: not its statement, its agent's test command or its labels, nor where its
# files lie (repo_src, the cassette's path: base_commit and the cassette's sha256 name their content).
VERDICT_FIELDS = ("repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS", "version", "image",
                  "eval_script", "log_parser", "test_cmd", "mirror", "sdist")


def task_digest(task: Task) -> str:
    """A digest of what decides `task`'s verdict (VERDICT_FIELDS), kept in its record, so that a resume whose
    task set has changed a decided task is refused instead of keeping a verdict on another task."""
    row = {name: getattr(task, name) for name in VERDICT_FIELDS}
    row["http_replay"] = task.http_replay and task.http_replay["sha256"]
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=list).encode()).hexdigest()[:16]


def _run(engine: ForkEngine, task: Task, seed: int, gold: bool, timeout: float,
         recording: bool = False) -> tuple[VerifierResult | str, Traffic]:
    """One verifier run in a fresh sandbox (the gold patch applied first when `gold`) and its HTTP
    traffic (crr.sandbox.http); a str says why the gold patch did not apply."""
    with engine.start(task) as sb:
        if gold and task.patch.strip():
            path = f"{SCRATCH_DIR}/gold.patch"  # inside .git: never part of the diff verify() takes
            patch = task.patch if task.patch.endswith("\n") else task.patch + "\n"
            sb.write_file(path, patch.encode())
            applied = sb.exec(f"git apply --verbose {path}", timeout=300)
            if applied.exit_code != 0:
                return f"git apply of the gold patch failed: {applied.output.strip()[-400:]}", Traffic()
        result = verify(sb, task, timeout=timeout, seed=seed)
        return result, collect(sb, recording) if task.mirror else Traffic()


def _save_cassette(cassettes: Path | None, instance_id: str, data: bytes) -> dict:
    """The recorded cassette in the run directory; the task's http_replay field for it."""
    if cassettes is None:
        raise CRRError("recording HTTP needs a directory for the cassettes")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance_id)
    path = cassettes / f"{safe}.yaml"
    atomic_write_text(path, data.decode("utf-8"))
    return {"cassette": str(path), "sha256": hashlib.sha256(data).hexdigest()}


def _misses(traffic: Traffic, where: str) -> str:
    shown = ", ".join(f"{m['method']} {m['uri']}" for m in traffic.misses[:3])
    more = f" and {len(traffic.misses) - 3} more" if len(traffic.misses) > 3 else ""
    return (f"{where} made HTTP request(s) with no recording: {shown}{more} (sandboxes have no network; "
            "record with --record-http, or drop the task)")


# ------------------------------------------------------------------------------------ run directories

COMMAND = "filter-tasks"
# What a run is made of, stored in its config.yaml; None in `open_run`'s settings means "not given".
DEFAULTS = {"tasks": None, "limit": None, "engine": "local", "engine_options": None, "mode": None, "ray": None,
            "reruns": 3, "seed": 0, "timeout": VERIFY_TIMEOUT_S, "record_http": False}
# Where the sandboxes run, not what decides a verdict: a resume may name another Ray cluster.
_RESUMABLE = ("ray",)


def open_run(settings: dict, out: Path | str, resume: Path | str | None = None
             ) -> tuple[RunDir, dict, list[Task]]:
    """The run directory, its settings and its task set. `resume` (or an `out` that is already a
    filter-tasks run) is reopened with the settings it was made with, and a given setting that
    differs is an error (so a resume cannot mix verdicts); otherwise the settings are checked and the
    tasks loaded first, and only then is a new run made under `out`."""
    out = Path(out)
    if settings.get("tasks") is not None and Path(settings["tasks"]).exists():
        # a path: stored absolute, so the run resumes from any directory
        settings = {**settings, "tasks": str(Path(settings["tasks"]).resolve())}
    if resume is None and (out / "manifest.json").is_file():
        resume = out
    if resume is not None:
        run = RunDir.open(resume)
        if run.manifest.get("command") != COMMAND:
            raise CRRError(f"{run.path} was made by `crr {run.manifest.get('command')}`, not `crr {COMMAND}`")
        run.lock()
        stored = {**DEFAULTS, **run.config}
        stored.update({k: settings[k] for k in _RESUMABLE if settings.get(k) is not None})
        changed = {k: (stored[k], v) for k, v in settings.items() if v is not None and v != stored.get(k)}
        if changed:
            what = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise CRRError(f"{run.path} was made with other settings ({what}); resume it without them "
                           "or start a new run")
        tasks = _load(stored)
        _check_recorded(run, tasks)
        return run, stored, tasks
    merged = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    if merged["tasks"] is None:
        raise CRRError("give --tasks FILE|DIR|DATASET (or --resume RUN_DIR)")
    config = filter_config(merged)
    tasks = _load(merged)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(merged["tasks"]).stem)[:60]
    run = RunDir.create(COMMAND, name or "tasks", root=out, config=merged, seeds={"filter": config.seed})
    return run, merged, tasks


def filter_config(settings: dict) -> FilterConfig:
    """The FilterConfig of a run's settings (DEFAULTS' keys), checked."""
    spec = engine_spec_of(settings)
    if settings["limit"] is not None and settings["limit"] < 1:
        raise CRRError(f"--limit must be at least 1, got {settings['limit']}")
    return FilterConfig(engine=spec.name, engine_options=spec.options,
                        reruns=settings["reruns"], seed=settings["seed"], timeout=settings["timeout"],
                        record_http=settings["record_http"])


def _load(settings: dict) -> list[Task]:
    """The run's task set: load_tasks(settings["tasks"]), the first `limit` of them when set."""
    tasks = _unique(load_tasks(settings["tasks"]))
    if not tasks:
        raise CRRError(f"{settings['tasks']} holds no tasks")
    return tasks[:settings["limit"]] if settings["limit"] else tasks


# ------------------------------------------------------------------------------------ many tasks

@dataclass
class Summary:
    tasks: int             # in the task set (after --limit)
    evaluated: int         # admitted + discarded
    admitted: int
    discarded: int
    infra_errors: int
    pending: int           # not finished yet (an interrupted run)
    discard_rate: float | None
    tasks_per_min: float | None  # this invocation's finished tasks per wall-clock minute
    run_dir: str

    def line(self) -> str:
        rate = "n/a" if self.discard_rate is None else f"{100 * self.discard_rate:.1f}%"
        speed = "n/a" if self.tasks_per_min is None else f"{self.tasks_per_min:.1f}"
        pending = f", {self.pending} pending" if self.pending else ""
        return (f"evaluated {self.evaluated}, admitted {self.admitted}, discarded {self.discarded} "
                f"(discard rate {rate}), infra errors {self.infra_errors}{pending}, {speed} tasks/min")


def filter_tasks(tasks: Iterable[Task], run: RunDir, config: FilterConfig, workers: int | None = None,
                 on_start: Callable[[int, dict[str, int]], None] | None = None,
                 on_result: Callable[[dict], None] | None = None) -> Summary:
    """Filter `tasks` into `run`, skipping those it already decided; returns the summary.

    Tasks it recorded as infra errors are tried again (the machine, not the task, failed). `workers`
    run tasks in parallel (None: DEFAULT_WORKERS, or a Ray engine's sandbox slots); each record is
    appended as its task finishes. On Ctrl-C the engine is closed (killing the sandboxes in flight,
    whose tasks are not recorded) and the interrupt is re-raised; `resume` later picks up where it stopped.
    `on_start(total, verdicts)` (the counts of the verdicts already recorded, by verdict) and `on_result(record)`
    are called from the calling thread.
    """
    if workers is not None and workers < 1:
        raise CRRError(f"--workers must be at least 1, got {workers}")
    tasks = _unique(tasks)
    decided = {i: r["verdict"] for i, r in _check_recorded(run, tasks).items() if r["verdict"] != INFRA_ERROR}
    todo = sorted((t for t in tasks if t.instance_id not in decided), key=lambda t: t.instance_id)
    if on_start:
        on_start(len(tasks), dict(Counter(decided.values())))
    start, finished = time.monotonic(), 0
    if todo:
        spec = EngineSpec(config.engine, config.engine_options)
        engine = spec.make()
        recorder = spec.make(record_http=True) if config.record_http else None
        workers = engine_workers(engine, workers, DEFAULT_WORKERS)
        log.info("filtering %d tasks (%d already decided) with %d workers on the %s engine",
                 len(todo), len(tasks) - len(todo), workers, config.engine)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="crr-filter")
        try:
            futures = [pool.submit(check_task, engine, task, config, recorder, run.path / CASSETTES)
                       for task in todo]
            for future in as_completed(futures):
                record = future.result()
                run.append(RESULTS, record)
                finished += 1
                log.info("%s: %s%s", record["instance_id"], record["verdict"],
                         f" ({record['reason']})" if record["reason"] else "")
                if on_result:
                    on_result(record)
        finally:  # also on Ctrl-C: queued tasks never start, sandboxes in flight are closed
            pool.shutdown(wait=False, cancel_futures=True)
            engine.close()
            if recorder is not None:
                recorder.close()
            pool.shutdown(wait=True)
    elapsed = time.monotonic() - start
    return write_outputs(run, tasks, tasks_per_min=60 * finished / elapsed if finished and elapsed else None)


def write_outputs(run: RunDir, tasks: Iterable[Task], tasks_per_min: float | None = None) -> Summary:
    """(Re)build admitted/discarded/infra_errors, the discard table and summary.json from
    results.jsonl, in instance-id order; the last record of a task wins."""
    tasks = _unique(tasks)
    by_id = {t.instance_id: t for t in tasks}
    latest = _check_recorded(run, tasks)
    records = [latest[i] for i in sorted(latest)]
    verdicts = {v: [r for r in records if r["verdict"] == v] for v in (ADMITTED, DISCARDED, INFRA_ERROR)}
    write_tasks([_admitted(by_id[r["instance_id"]], r, run) for r in verdicts[ADMITTED]],
                run.path / "admitted.jsonl")
    for name, verdict in (("discarded.jsonl", DISCARDED), ("infra_errors.jsonl", INFRA_ERROR)):
        run.write_text(name, "".join(json.dumps(r, sort_keys=True) + "\n" for r in verdicts[verdict]))
    table = discard_table(records)
    run.write_text("discard_table.csv", table.to_csv(index=False))
    run.write_text("discard_table.md", table.to_markdown(index=False, floatfmt=".1f") + "\n")
    evaluated = len(verdicts[ADMITTED]) + len(verdicts[DISCARDED])
    summary = Summary(tasks=len(tasks), evaluated=evaluated, admitted=len(verdicts[ADMITTED]),
                      discarded=len(verdicts[DISCARDED]), infra_errors=len(verdicts[INFRA_ERROR]),
                      pending=len(tasks) - len(records),
                      discard_rate=len(verdicts[DISCARDED]) / evaluated if evaluated else None,
                      tasks_per_min=tasks_per_min, run_dir=str(run.path))
    run.write_json("summary.json", asdict(summary))
    return summary


def _admitted(task: Task, record: dict, run: RunDir) -> Task:
    """The admitted row: the task, with the cassette its recording run saved (if any)."""
    replay = record.get("http_replay")
    return replace(task, http_replay={**replay, "cassette": str(run.path / replay["cassette"])}) if replay else task


def discard_table(records: list[dict]) -> pd.DataFrame:
    """Per repository, as in the paper's Table "Discard rate": tasks evaluated (admitted or
    discarded; infra errors were not evaluated), discarded, discard rate (%), and an `all` row."""
    columns = ["repository", "tasks evaluated", "discarded", "discard rate (%)"]
    rows = pd.DataFrame([(r["repo"], r["verdict"] == DISCARDED) for r in records
                         if r["verdict"] != INFRA_ERROR], columns=["repository", "discarded"])
    if rows.empty:
        return pd.DataFrame(columns=columns)
    table = (rows.groupby("repository")["discarded"].agg(["size", "sum"]).reset_index()
             .set_axis(columns[:3], axis=1)
             .sort_values(["tasks evaluated", "repository"], ascending=[False, True]))
    table.loc[len(table)] = ["all", len(rows), int(rows["discarded"].sum())]
    table["discard rate (%)"] = (100 * table["discarded"] / table["tasks evaluated"]).round(1)
    return table.reset_index(drop=True)


def _check_recorded(run: RunDir, tasks: list[Task]) -> dict[str, dict]:
    """The last record of each task in results.jsonl; a CRRError, before any task is checked, when a recorded
    task is not in `tasks` or was decided on other fields than its row has now (task_digest)."""
    by_id = {t.instance_id: t for t in tasks}
    latest = {r["instance_id"]: r for r in run.records(RESULTS)}
    unknown = sorted(set(latest) - set(by_id))
    changed = sorted(i for i, r in latest.items() if i in by_id and r["verdict"] != INFRA_ERROR
                     and "task_digest" in r and r["task_digest"] != task_digest(by_id[i]))   # (older runs: none)
    for ids, what in ((unknown, "tasks not in this task set"), (changed, "tasks whose rows have changed since")):
        if ids:
            raise CRRError(f"{run.path / RESULTS} has verdicts on {len(ids)} {what} (e.g. {ids[0]}); resume the "
                           "run with the task set it was started with, or start a new run")
    return latest


def _unique(tasks: Iterable[Task]) -> list[Task]:
    tasks = list(tasks)
    seen: set[str] = set()
    for t in tasks:
        if t.instance_id in seen:
            raise CRRError(f"instance_id {t.instance_id!r} appears twice in the task set; ids must be unique")
        seen.add(t.instance_id)
    return tasks
