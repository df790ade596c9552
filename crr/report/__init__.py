"""`crr report`: the paper's tables and figures from run directories only.

    report = write_tables([Path("results/cpu-main")], Path("results/cpu-main/report"))
    report = write_plots([Path("results/cpu-main")], Path("results/cpu-main/report"))

Both find the `crr train` / `crr eval` runs at or under the given paths (crr.report.runs), and the `crr credit
audit` runs (crr.report.credit), write their outputs (following the shipped comparison specs of the runs' scale, or
the one `spec` given)
and keep an index, report.md (with report.json, the same as data), of everything written to `out` so far:
each entry's status (complete, partial, missing), files, and the runs still to make.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from crr.experiments import Comparison, display_path
from crr.report.output import missing_markdown, write_table
from crr.report.runs import Runs, load_runs
from crr.rundir import atomic_write_json, atomic_write_text, read_run_mapping

INDEX = "report.json"


@dataclass
class Entry:
    name: str
    kind: str            # table | figure
    title: str
    status: str          # complete | partial | missing
    files: list[str]
    missing: list[dict]  # {what, commands}


def write_tables(paths: list[Path], out: Path, spec: Comparison | None = None) -> tuple[Runs, list[Entry]]:
    from crr.report.credit import credit_tables  # deferred: pandas and pyarrow
    from crr.report.tables import all_tables

    credit = credit_tables(paths)
    runs = load_runs(paths, require=not credit, spec=spec)
    entries = []
    for t in (all_tables(runs) if runs.train or runs.evals or not credit else []) + credit:
        files = write_table(t, out)
        entries.append(Entry(t.name, "table", t.title, t.status, [f.name for f in files],
                             [{"what": m.what, "commands": m.commands} for m in t.missing]))
    _index(runs, out, entries)
    return runs, entries


def write_plots(paths: list[Path], out: Path, spec: Comparison | None = None) -> tuple[Runs, list[Entry]]:
    from crr.report.credit import credit_plots  # deferred: matplotlib
    from crr.report.plots import all_plots

    credit = credit_plots(paths, out)
    runs = load_runs(paths, require=not credit, spec=spec)
    entries = []
    for p in (all_plots(runs, out) if runs.train or runs.evals or not credit else []) + credit:
        status = "missing" if not p.files else "partial" if p.missing else "complete"
        entries.append(Entry(p.name, "figure", p.title, status, [f.name for f in p.files],
                             [{"what": m.what, "commands": m.commands} for m in p.missing]))
    _index(runs, out, entries)
    return runs, entries


def _runs_markdown(runs: Runs) -> str:
    train = pd.DataFrame([{"arm": r.arm.label, "seed": r.seed, "updates": r.updates,
                           "trajectories": sum(it["trajectories"] for it in r.iterations),
                           "wall clock (s)": f"{r.wall_s:.1f}", "finished": "yes" if r.complete else "no",
                           "run": r.path.name} for r in sorted(runs.train, key=lambda r: (r.arm.label, r.seed))])
    dash = lambda v: "—" if v is None else str(v)  # noqa: E731  (pandas would print None among ints as nan)
    rate = lambda e: e.summary.get("pass_at_1") if e.complete else None  # noqa: E731  (None: all infra failures)
    evals = pd.DataFrame([{"arm": e.label, "seed": dash(e.seed), "dataset": e.dataset, "samples": e.samples,
                           "update": dash(e.step), "pass@1": dash(None if rate(e) is None else f"{100 * rate(e):.1f}"),
                           "run": e.path.name}
                          for e in sorted(runs.evals, key=lambda e: (e.label, e.seed or 0, e.step or 0))])
    parts = [f"## Runs ({runs.scale} scale)\n"]
    for title, df in (("Train runs", train), ("Eval runs", evals)):
        parts.append(f"### {title}\n\n"
                     + (df.to_markdown(index=False, disable_numparse=True) if not df.empty else "none") + "\n")
    if runs.ignored:
        parts.append("Ignored (not train or eval runs): " + ", ".join(runs.ignored) + "\n")
    return "\n".join(parts)


def _index(runs: Runs, out: Path, entries: list[Entry]) -> None:
    """Merge this command's entries into out/report.json and rewrite report.md from it."""
    path = out / INDEX
    index = read_run_mapping(path) if path.is_file() else {"entries": []}
    mine = {(e.kind, e.name): e.__dict__ for e in entries}
    # in place of the entries this command rewrote, then the new ones, so that tables keep the paper's order
    index["entries"] = [mine.pop((e["kind"], e["name"]), e) for e in index["entries"]] + list(mine.values())
    index["runs_markdown"] = _runs_markdown(runs)
    atomic_write_json(path, index)
    lines = ["# crr report\n", "Made by `crr report tables` / `crr report plots` from run directories only.\n"]
    for kind in ("table", "figure"):
        items = [e for e in index["entries"] if e["kind"] == kind]
        if not items:
            continue
        lines.append(f"## {kind.capitalize()}s\n")
        for e in items:
            links = ", ".join(f"[{f}]({f})" for f in e["files"]) or "not drawn"
            lines.append(f"- **{e['title']}** ({e['status']}): {links}")
        lines.append("")
    todo = {m["what"]: m["commands"] for e in index["entries"] for m in e["missing"]}
    if todo:
        from crr.report.tables import Missing  # deferred: pandas and pyarrow

        lines.append("## Runs still to make\n")
        specs = ", ".join(f"`crr experiment run {display_path(s.path)}`" for s in runs.catalogue.specs.values())
        lines.append(f"Each comparison's runs and evaluations are made (resumably) by {specs}; one by one:\n")
        lines.append(missing_markdown([Missing(w, c) for w, c in todo.items()]))
    lines.append(index["runs_markdown"])
    atomic_write_text(out / "report.md", "\n".join(lines))
