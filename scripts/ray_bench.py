"""Benchmark for the report (not a timed test): tool-call and fork latency through the ray:local engine
against the local engine directly, in one run (crr.bench.fork.ray_bench).

    .venv/bin/python scripts/ray_bench.py [--address ADDR] [--inner local|docker] [--files N] [--repeats N]

Without --address it starts a throwaway two-raylet ray.cluster_utils.Cluster on this machine: the difference
is then Ray's own dispatch cost (driver -> sandbox host actor -> the same engine), with no network in it.
Needs the ray extra (pip install -e '.[ray]').
"""

from __future__ import annotations

import argparse
import json

from crr.bench.fork import ray_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default=None, help="a Ray cluster's address (default: a throwaway local one)")
    ap.add_argument("--inner", default="local")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    r = ray_bench(args.address, args.inner, n_files=args.files, repeats=args.repeats)
    print(json.dumps(r, indent=1))
    print(f"\n{'ms p50 / p95':14} {'direct':>16} {'ray':>16} {'overhead p50':>13}")
    for key in ("exec", "read", "fork"):
        d, y = r["direct"], r["ray"]
        print(f"{key:14} {d[f'{key}_ms_p50']:7.1f} / {d[f'{key}_ms_p95']:6.1f} "
              f"{y[f'{key}_ms_p50']:7.1f} / {y[f'{key}_ms_p95']:6.1f} {r[f'{key}_overhead_ms_p50']:13.1f}")


if __name__ == "__main__":
    main()
