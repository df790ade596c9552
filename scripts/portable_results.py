"""Make a results directory portable before it is committed: run directories record the absolute paths of
the machine that made them (model, train_run, checkpoint, run_dir, ...); a committed reference must not
(tests/test_committed_results.py). Rewrites, in every text file under DIR, this checkout's absolute path to
paths relative to the repository root, and the crr cache under the home directory to ~/.cache/crr; `crr
report` run from the repository root reads the rewritten directories as it read the originals.

    .venv/bin/python scripts/portable_results.py results/reference/cpu-main
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = {".json", ".jsonl", ".yaml", ".md", ".csv", ".tex", ".log", ".txt"}


def portable(text: str) -> str:
    return (text.replace(f"{ROOT}/", "").replace(str(ROOT), ".")
            .replace(f"{Path.home()}/.cache/crr", "~/.cache/crr"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    args = ap.parse_args()
    changed = 0
    for d in args.dirs:
        for path in sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in TEXT):
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
            new = portable(text)
            if new != text:
                path.write_text(new, encoding="utf-8", errors="surrogateescape")
                changed += 1
    print(f"{changed} file(s) rewritten")


if __name__ == "__main__":
    main()
