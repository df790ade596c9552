"""What a signalled crr command leaves, per engine and signal, before the next command and after it; and the
records and unique tasks once the interrupted run is resumed. Prints one JSON line per case.

    python research/interrupt_figures.py [--engines local docker] [--signals TERM KILL] [--commands filter eval]

Runs real `crr filter-tasks` / `crr eval` processes on 8 generated micro tasks in a temporary directory
(its own crr cache), signals each once its first record is written, then resumes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["local", "docker"])
    parser.add_argument("--signals", nargs="+", default=["TERM", "KILL"])
    parser.add_argument("--commands", nargs="+", default=["filter", "eval"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="crr-interrupt-figures-"))
    os.environ.setdefault("CRR_CACHE_DIR", str(work / "cache"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    from faults import ENGINES, descendants, leftovers, survivors, wait_for_records

    from crr.policy.model import default_model_dir
    from crr.rundir import RunDir
    from crr.tasks.micro import generate_micro

    tasks = work / "tasks"
    generate_micro(tasks, n=8, seed=3, split="train")
    model = str(default_model_dir())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for engine in args.engines:
        for command in args.commands:
            for name in args.signals:
                out = work / f"{engine}-{command}-{name}"
                start = (["filter-tasks", "--tasks", str(tasks), *ENGINES[engine]] if command == "filter" else
                         ["eval", "tasks", str(tasks), "--model", model, "--max-turns", "2", "--max-new-tokens", "32",
                          "--batch", "2", *ENGINES[engine][:2]])
                proc = subprocess.Popen([sys.executable, "-m", "crr", *start, "--out", str(out)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                run = wait_for_records("*/results.jsonl", out, proc)
                kids = descendants(proc.pid)
                proc.send_signal(getattr(signal, f"SIG{name}"))
                proc.communicate(timeout=120)
                before = leftovers(proc.pid)
                procs_before = len(survivors(kids))
                recorded = len(RunDir(run).records("results.jsonl"))
                resume = (["filter-tasks", "--resume", str(run)] if command == "filter"
                          else ["eval", "--resume", str(run)])
                done = subprocess.run([sys.executable, "-m", "crr", *resume], env=env, capture_output=True, text=True,
                                      check=False)
                ids = [r["instance_id"] for r in RunDir(run).records("results.jsonl")]
                count = lambda things, kind: sum(t.startswith(kind) for t in things)  # noqa: E731
                after = leftovers(proc.pid)
                print(json.dumps({
                    "engine": engine, "command": command, "signal": f"SIG{name}", "exit": proc.returncode,
                    "left_before_next_command": {k: count(before, k) for k in ("container", "image", "mount", "dir",
                                                                                "cgroup")} | {"process": procs_before},
                    "left_after_next_command": {k: count(after, k) for k in ("container", "image", "mount", "dir",
                                                                              "cgroup")}
                                               | {"process": len(survivors(kids))},
                    "records_when_signalled": recorded, "resume_exit": done.returncode,
                    "records_after_resume": len(ids), "unique_tasks_after_resume": len(set(ids)), "tasks": 8}),
                    flush=True)


if __name__ == "__main__":
    main()
