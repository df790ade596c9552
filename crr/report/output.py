"""Writing tables (Markdown, LaTeX booktabs, CSV) and the report index. A table whose runs are missing is
written anyway: its Markdown says which runs to make and the commands that make them, and its LaTeX carries
the same list as comments, so no table is silently skipped."""

from __future__ import annotations

from pathlib import Path

from crr.report.tables import Missing, Table
from crr.rundir import atomic_write_text

# pandas escapes LaTeX in cells but not in captions, and leaves these non-ASCII signs to the document's font
_LATEX_SIGNS = {"±": r"$\pm$", "Δ": r"$\Delta$", "—": "--"}
_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "|": r"\textbar{}"}


def _signs(text: str) -> str:
    for sign, tex in _LATEX_SIGNS.items():
        text = text.replace(sign, tex)
    return text


def latex_escape(text: str) -> str:
    return _signs("".join(_LATEX_SPECIAL.get(c, c) for c in text))


def missing_markdown(missing: list[Missing]) -> str:
    lines = ["**Missing runs.** Make them (then re-run `crr report`) with:", ""]
    for m in missing:
        lines.append(f"- {m.what}:")
        lines += [f"  `{c}`" for c in m.commands]
    return "\n".join(lines) + "\n"


def to_markdown(t: Table) -> str:
    parts = [f"# {t.title}\n", f"{t.caption}\n"]
    if t.status == "missing":
        parts.append("**No data yet:** none of the runs this table needs are in --runs.\n")
    else:
        # disable_numparse: keep cells as written ("+5.3", "1,024"), not re-formatted by tabulate
        parts.append(t.display.to_markdown(index=False, disable_numparse=True) + "\n")
    parts += [f"Note: {n}\n" for n in t.notes]
    if t.missing:
        parts.append(missing_markdown(t.missing))
    return "\n".join(parts)


def to_latex(t: Table) -> str:
    body = t.display.to_latex(index=False, escape=True, caption=latex_escape(t.caption), label=f"tab:{t.name}",
                              position="htbp", column_format="l" + "r" * (t.display.shape[1] - 1))
    comments = [f"% missing: {m.what}: {c}" for m in t.missing for c in m.commands]
    return "\n".join([f"% {t.title} (crr report; booktabs)", *comments, _signs(body)])


def write_table(t: Table, out: Path) -> list[Path]:
    written = [out / f"{t.name}.md"]
    atomic_write_text(written[0], to_markdown(t))
    if t.status != "missing":
        atomic_write_text(out / f"{t.name}.tex", to_latex(t))
        atomic_write_text(out / f"{t.name}.csv", t.data.to_csv(index=False))
        written += [out / f"{t.name}.tex", out / f"{t.name}.csv"]
    return written
