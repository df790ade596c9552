"""Benchmark for the report (not a timed test): determinism-filter throughput on the local engine and on
ray:local over throwaway clusters of 1 and 2 raylets on this machine, in one run
(crr.bench.filter.ray_filter_bench).

    .venv/bin/python scripts/ray_filter_bench.py [--tasks nano-band] [--n 8] [--slots 2] [--reruns 3]

Every row has the same sandbox slots and workers (--slots), so a second raylet on the same machine adds no
cores: the figure is Ray's scheduling overhead per task, not a speed-up. Needs the ray extra.
"""

from __future__ import annotations

import argparse
import json

from crr.bench.filter import ray_filter_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="nano-band")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--reruns", type=int, default=3)
    args = ap.parse_args()
    r = ray_filter_bench(args.n, args.tasks, slots=args.slots, reruns=args.reruns)
    print(json.dumps(r, indent=1))
    print(f"\n{r['n']} {r['tasks']} tasks, {r['reruns']} reruns, {r['slots']} workers; "
          f"same verdicts: {r['same_verdicts']}")
    print(f"{'engine':10} {'nodes':>5} {'wall s':>8} {'tasks/s':>8} {'host start s':>13} "
          f"{'overhead ms/task':>17} {'less the start':>15}")
    for row in r["rows"]:
        if not row["nodes"]:
            print(f"{row['engine']:10} {'-':>5} {row['wall_s']:8.2f} {row['tasks_per_s']:8.3f}")
            continue
        print(f"{row['engine']:10} {row['nodes']:>5} {row['wall_s']:8.2f} {row['tasks_per_s']:8.3f} "
              f"{row['host_start_s']:13.2f} {row['overhead_ms_per_task']:+17.1f} "
              f"{row['overhead_ms_per_task_after_start']:+15.1f}")


if __name__ == "__main__":
    main()
