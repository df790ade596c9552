"""Benchmark for the report (not a timed test): what a pytest run costs in a local sandbox of a task without its own
environment, with crr's installed pytest plugins autoloaded (as before) and without (the engine's default since
2026-11-29): the verifier's eval script and the agent's run_tests command, alternating, median of --repeats each.

    .venv/bin/python scripts/pytest_cost.py [--repeats 6] [TASKS ...]     # default: nano-band multi-band
"""

from __future__ import annotations

import argparse
import statistics
import time

from crr.agent.tools import SCRATCH_DIR
from crr.agent.verifier import swebench_spec
from crr.sandbox.local import LocalEngine
from crr.tasks.loaders import load_tasks

AUTOLOAD = {"": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": ""}, "out": {}}   # "" turns the engine's "1" off again


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("tasks", nargs="*", default=["nano-band", "multi-band"])
    args = ap.parse_args()
    for name in args.tasks:
        task = load_tasks(name)[0]
        with LocalEngine() as engine, engine.start(task) as sb:
            sb.write_file(f"{SCRATCH_DIR}/eval.sh", swebench_spec(task).eval_script.encode())
            for what, cmd in {"verifier run": f"bash {SCRATCH_DIR}/eval.sh",
                              "run_tests": task.run_tests_cmd or task.test_cmd}.items():
                seconds: dict[str, list[float]] = {k: [] for k in AUTOLOAD}
                for _ in range(args.repeats):
                    for plugins, env in AUTOLOAD.items():
                        t0 = time.perf_counter()
                        sb.exec(cmd, env=env, timeout=120)
                        seconds[plugins].append(time.perf_counter() - t0)
                on, off = (statistics.median(seconds[k]) for k in AUTOLOAD)
                print(f"{name} {what}: {on:.3f} s with crr's pytest plugins, {off:.3f} s without ({off / on:.2f}x)")


if __name__ == "__main__":
    main()
