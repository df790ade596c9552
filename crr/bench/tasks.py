"""Task generation: `crr tasks bench` (tasks per second of crr.tasks.micro, and what the tasks look like)."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from crr.tasks.micro import generate_micro, pinned_git


def bench_micro(n: int, seed: int = 0, split: str = "train", tier: str = "nano", workers: int = 1,
                warm: bool = True, sample: int = 50) -> dict:
    """Generate `n` tasks into a throw-away directory and time it (a benchmark command, not a test).

    Returns {"n", "seconds", "tasks_per_s", "families": {family: count}, "files": {kind: {"mean_lines",
    "mean_chars", "mean_tokens"}}, "issue_chars"}: file sizes at base_commit over the first `sample` tasks
    (kinds: "source" = the package's modules, "test" = test files, "other" = README, pyproject, __init__),
    tokens counted as words and punctuation marks (a tokenizer-free proxy).
    """
    root = Path(tempfile.mkdtemp(prefix="crr-micro-bench-"))
    try:
        start = time.perf_counter()
        tasks = generate_micro(root / "set", n=n, seed=seed, split=split, tier=tier, workers=workers, warm=warm)
        seconds = time.perf_counter() - start
        sizes: dict[str, list[tuple[int, int, int]]] = {"source": [], "test": [], "other": []}
        for task in tasks[:sample]:
            clone = root / "clone"
            pinned_git(root, "clone", "-q", task.repo_src, str(clone))
            package = task.metadata["package"]
            for path in sorted(p for p in clone.rglob("*") if p.is_file() and ".git" not in p.parts):
                rel = path.relative_to(clone).as_posix()
                kind = ("test" if rel.startswith("tests/") else
                        "source" if rel.startswith(f"{package}/") and path.name != "__init__.py" else "other")
                text = path.read_text()
                sizes[kind].append((text.count("\n"), len(text), len(re.findall(r"\w+|[^\w\s]", text))))
            shutil.rmtree(clone)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def mean(values: list[int]) -> float:
        return round(sum(values) / len(values), 1) if values else 0.0

    return {"n": n, "tier": tier, "split": split, "workers": workers, "warm": warm, "seconds": round(seconds, 2),
            "tasks_per_s": round(n / seconds, 3),
            "families": dict(sorted(Counter(t.metadata["bug_family"] for t in tasks).items())),
            "files": {kind: {"per_task": round(len(rows) / min(sample, n), 2),
                             "mean_lines": mean([r[0] for r in rows]), "mean_chars": mean([r[1] for r in rows]),
                             "mean_tokens": mean([r[2] for r in rows])} for kind, rows in sizes.items()},
            "issue_chars": mean([len(t.problem_statement) for t in tasks]),
            **({"n_bugs": dict(sorted(Counter(t.metadata["n_bugs"] for t in tasks).items()))}
               if tier == "multi" else {})}
