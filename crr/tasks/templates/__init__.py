"""Source templates of the embedded micro task set: small, realistic Python packages and their tests.

A template is a package in a domain (inventory, text statistics, ...) of two or three modules with
documented functions. `cases` lists, per public function, argument lists written as Python source;
the generator computes each expected value by running the correct code, so tests are right by
construction. Templates are split between train and test (disjoint domains); the shared FILLERS are
generic utility modules added to reach a task's module count: code an agent has to read past. Bugs
are only injected in template modules, never in fillers.

The templates are data files beside this loader, real modules one can open, lint and run:
`<split>/<template>/<module>.py` with `template.json` (name, split, candidate package names, purpose,
and per module its cases, in module order), `fillers/<module>.py` with `fillers/fillers.json`, and
`index.json` for the order of TEMPLATES. A module's source is its file's bytes, so a task's package
holds exactly what the file holds. These folders are not Python packages (no __init__.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.resources import files
from importlib.resources.abc import Traversable


@dataclass(frozen=True)
class Module:
    name: str                                   # module file name without .py
    source: str
    cases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # function -> argument sources


@dataclass(frozen=True)
class Template:
    name: str
    split: str                   # "train" or "test": the pool it belongs to
    packages: tuple[str, ...]    # candidate package names
    purpose: str                 # what a user does with it, for the README and the issue text
    modules: tuple[Module, ...]


_DATA = files(__name__)


def _json(path: Traversable) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _modules(folder: Traversable, cases: dict[str, dict[str, list[str]]]) -> tuple[Module, ...]:
    """The modules `cases` names, in its order, from `folder`'s .py files (all of them, no others)."""
    on_disk = {p.name.removesuffix(".py") for p in folder.iterdir() if p.is_file() and p.name.endswith(".py")}
    if on_disk != set(cases):
        raise RuntimeError(f"templates: {folder} holds modules {sorted(on_disk)}, "
                           f"its JSON lists {sorted(cases)}")
    return tuple(Module(name, (folder / f"{name}.py").read_bytes().decode("utf-8"),
                        {fn: tuple(args) for fn, args in fn_cases.items()})
                 for name, fn_cases in cases.items())


def _template(path: str) -> Template:
    split, name = path.split("/")
    folder = _DATA / split / name
    meta = _json(folder / "template.json")
    if (meta["split"], meta["name"]) != (split, name):
        raise RuntimeError(f"templates: {folder}/template.json names {meta['split']}/{meta['name']}")
    return Template(name, split, tuple(meta["packages"]), meta["purpose"], _modules(folder, meta["modules"]))


TEMPLATES: tuple[Template, ...] = tuple(_template(p) for p in _json(_DATA / "index.json")["templates"])

FILLERS: tuple[Module, ...] = _modules(
    _DATA / "fillers", _json(_DATA / "fillers" / "fillers.json")["modules"])


def templates_for(split: str) -> tuple[Template, ...]:
    return tuple(t for t in TEMPLATES if t.split == split)
