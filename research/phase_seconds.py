"""Where a training run's rollout and branch seconds go: `crr train` (method crr, k = 4, K = 1, the policy fixed by
learning_rate=1e-12, as scripts/train_bench.py runs it) with the backend's generate calls, the local sandboxes'
commands, the verifier runs and the engine's starts, restores and snapshots timed, each charged to the ledger
phase open when it began (rollout_s, cf_rollout_s, cf_test_s). Prints the run's ledger totals, then per phase and
kind: calls, rows (generate) and summed seconds, and the CPU seconds each phase used (this process's threads and
the sandbox commands it waited for, getrusage). Work done in worker threads overlaps, so a phase's kinds can sum
to more than its wall clock; verifier runs include their commands. Use branches_beside_update=false, so that the
branches run in phases of their own, one at a time, and not beside the learner update (charged to cf_beside_s).

    OMP_NUM_THREADS=1 .venv/bin/python research/phase_seconds.py PRESET|- UPDATES [key=value ...]

Used for docs/training.md, "What a branch is made of".
"""

from __future__ import annotations

import collections
import contextlib
import json
import resource
import sys
import tempfile
import threading
import time

import crr.agent.verdicts as verdicts
import crr.agent.verifier as verifier
from crr.policy.backend import TransformersBackend
from crr.sandbox.local.engine import LocalEngine
from crr.sandbox.local.sandbox import LocalSandbox
from crr.train.config import load_config, parse_overrides
from crr.train.ledger import Ledger
from crr.train.trainer import start_run, train

current: list[Ledger] = []
totals: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0, 0.0])   # calls, rows, seconds
cpu: collections.Counter = collections.Counter()   # CPU seconds by phase
lock = threading.Lock()


def cpu_seconds() -> float:
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage,
                                                    (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def timed(owner, name: str, kind: str, rows=lambda args: 0) -> None:
    call = getattr(owner, name)

    def wrapper(*args, **kwargs):
        phase = (current[-1]._phase if current else None) or "other"
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            with lock:
                entry = totals[(phase, kind)]
                entry[0] += 1
                entry[1] += rows(args)
                entry[2] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    preset, updates, overrides = sys.argv[1], int(sys.argv[2]), parse_overrides(sys.argv[3:])
    begin = Ledger.begin

    def begin_and_note(self, iteration):
        current[:] = [self]
        return begin(self, iteration)

    Ledger.begin = begin_and_note
    phase = Ledger.phase

    @contextlib.contextmanager
    def phase_and_cpu(self, name):
        start = cpu_seconds()
        with phase(self, name):
            yield
        cpu[name] += cpu_seconds() - start

    Ledger.phase = phase_and_cpu
    timed(TransformersBackend, "generate", "generate", rows=lambda args: len(args[1]))
    timed(LocalSandbox, "exec", "command")
    timed(verifier, "verify", "verifier run")
    verdicts.verify = verifier.verify   # (the memo calls it by the name it imported)
    for name in ("start", "restore", "_snapshot"):
        timed(LocalEngine, name, name.strip("_"))
    out = tempfile.mkdtemp(prefix="crr-phase-seconds-")
    cfg = load_config(None if preset == "-" else preset,
                      {"cf_samples": 1, **overrides, "method": "crr", "k": 4, "learning_rate": 1e-12,
                       "max_steps": updates, "output_dir": out})
    run = start_run(cfg, out)
    train(cfg, run)
    iterations = json.loads((run.path / "ledger.json").read_text())["iterations"]
    print(json.dumps({k: round(sum(it[k] for it in iterations), 3) for k in iterations[0] if k != "iteration"}))
    for (phase, kind), (calls, rows, seconds) in sorted(totals.items()):
        print(f"{phase:13s} {kind:13s} calls {calls:5d} rows {rows:5d} seconds {seconds:8.3f}")
    for phase, seconds in sorted(cpu.items()):
        print(f"{phase:13s} CPU seconds {seconds:8.3f}")


if __name__ == "__main__":
    main()
