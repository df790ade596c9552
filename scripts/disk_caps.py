"""What each engine's disk cap allows, and what the Docker engine's caps cost per action (issue 31).

    scripts/disk_caps.py caps     # per engine and mode: MB held when a writer outside /tmp and /testbed stops
    scripts/disk_caps.py actions  # Docker, per mode: p50 of one `true` action, in a fresh sandbox and with
                                  # 2,000 files in the writable layer; fork p50 (crr.sandbox.bench)

Run with the code to measure first on PYTHONPATH; `actions` runs on older crr trees too (before/after
in one session: alternate the two trees' PYTHONPATH). Prints one JSON object per line.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from crr.sandbox import get_engine
from crr.sandbox.bench import fork_bench, synthetic_task

CAP_MB = 64
# Writes files of {size} bytes into {where} until 3x the cap is written or a write fails.
WRITER = ("python3 -c \"import os, sys\nd, size, n = sys.argv[1], int(sys.argv[2]), 0\nos.makedirs(d, exist_ok=True)\n"
          "try:\n    for i in range(3 * {cap} * 2**20 // size):\n        with open(f'{{d}}/f{{i}}', 'wb') as f:\n"
          "            f.write(b'x' * size)\n"
          "        n += 1\nexcept OSError as e:\n    print(e)\" {where} {size}")
ENGINES = {"local": ("local", {}), "docker-commit": ("docker", {"mode": "commit"}),
           "docker-overlay": ("docker", {"mode": "overlay"})}


def caps(task) -> None:
    for label, (name, opts) in ENGINES.items():
        # Outside /tmp and /testbed: the commit layer anywhere (/opt); overlay: HOME, a scratch tmpfs of the
        # read-only root; local: its read-only root has no such place, so /testbed (same tmpfs as /tmp).
        where = {"docker-commit": "/opt/junk", "docker-overlay": "/root/junk", "local": "junk"}[label]
        for size in (4096, 32768, 3 * CAP_MB << 20):
            with get_engine(name, disk_limit_mb=CAP_MB, fsize_limit_mb=4 * CAP_MB, **opts) as eng, \
                    eng.start(task) as sb:
                t0 = time.monotonic()
                res = sb.exec(WRITER.format(cap=CAP_MB, where=where, size=size), timeout=600)
                wall = time.monotonic() - t0
                held = sb.exec(f"du -sk --apparent-size {where}").output.split()[0]
                print(json.dumps({"engine": label, "file_bytes": size, "cap_mb": CAP_MB, "held_mb": int(held) / 1024,
                                  "exit": res.exit_code, "wall_s": round(wall, 2),
                                  "said": (res.output.strip().splitlines() or [""])[-1][:120]}), flush=True)


def actions(task, repeats: int = 60) -> None:
    for mode in ("commit", "overlay"):
        with get_engine("docker", mode=mode) as eng, eng.start(task) as sb:
            out = {"mode": mode}
            for label in ("fresh", "2000_files"):
                if label == "2000_files":  # commit: in the watched layer; overlay: in HOME (read-only root)
                    sb.exec("mkdir -p ~/many && for i in $(seq 2000); do echo $i > ~/many/f$i; done", timeout=300)
                sb.exec("true")
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sb.exec("true")
                    times.append((time.perf_counter() - t0) * 1e3)
                out[f"action_ms_p50_{label}"] = round(statistics.median(times), 2)
        fork = fork_bench("docker", mode=mode, n_files=1000, repeats=20)
        out["fork_ms_p50"] = fork["fork_ms_p50"]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        task = synthetic_task(Path(tmp) / "repo", 50)
        {"caps": caps, "actions": actions}[sys.argv[1]](task)
