"""crr's own import graph keeps the layering of ARCHITECTURE.md, and its three extension points work.

The graph is read from the source with `ast`: every `import crr...` and `from crr... import` at any depth
(inside functions and `if TYPE_CHECKING:` blocks too), so an import moved into a function to dodge a cycle
still counts. `from crr.a import b` is an edge to the module crr.a.b when b is a module, else to crr.a.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "crr"

# Highest first; a module may import its own layer and any lower one, never a higher one. A module's layer is
# its folder's (or, for a module directly in crr/, its own name's): nothing else decides it.
LAYERS = [
    ("top", ("cli", "bench", "doctor", "demo", "__main__")),
    ("commands", ("filter", "train", "eval", "report", "credit", "sft", "experiments", "comparison")),
    ("rollout", ("rollout",)),
    ("agent/policy", ("agent", "policy")),
    ("tasks", ("tasks",)),
    ("sandbox", ("sandbox",)),
    ("base", ("rundir", "errors", "seeds", "plugins", "__init__")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(path: Path) -> int:
    top = path.relative_to(ROOT).parts[0].removesuffix(".py")
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{path.relative_to(ROOT)}: not in any layer of the architecture; add its folder to LAYERS "
                         "in this test and to ARCHITECTURE.md")


def imports(path: Path, name: str, known: set[str], source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every crr module `path` (or `source` standing for it) imports, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []

    def resolve(target: str) -> str:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        return target

    source = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, resolve(a.name)) for a in node.names if a.name.split(".")[0] == "crr"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "crr":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((node.lineno, sub if sub in known else resolve(base)))
    return out


def graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The modules and their edges: importer -> {imported: first line}."""
    mods = modules()
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        for line, target in imports(path, name, set(mods)):
            if target != name:
                edges[name].setdefault(target, line)
    return mods, edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a closed chain of modules) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)

    out = []
    for component in components:
        members, start = set(component), min(component)
        # shortest path from start back to start inside the component (breadth first)
        parents: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v]):
                    if w not in members:
                        continue
                    if w == start:
                        found = v
                        break
                    if w not in parents:
                        parents[w] = v
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        chain = [start]
        v = found
        while v != start:
            chain.append(v)
            v = parents[v]
        out.append([start, *reversed(chain[1:]), start])
    return out


def describe(chain: list[str], mods: dict[str, Path], edges: dict[str, dict[str, int]]) -> str:
    hops = [f"  {mods[a].relative_to(ROOT.parent)}:{edges[a][b]}: {a} imports {b}" for a, b in pairwise(chain)]
    return " -> ".join(chain) + "\n" + "\n".join(hops)


def test_no_import_cycles():
    mods, edges = graph()
    found = cycles(edges)
    assert not found, "import cycles in crr:\n" + "\n".join(describe(c, mods, edges) for c in found)


def test_no_import_from_a_lower_layer_into_a_higher_one():
    mods, edges = graph()
    bad = []
    for a, targets in sorted(edges.items()):
        for b, line in sorted(targets.items()):
            la, lb = layer_of(mods[a]), layer_of(mods[b])
            if lb < la:
                bad.append(f"  {mods[a].relative_to(ROOT.parent)}:{line}: {a} ({LAYERS[la][0]}) imports {b} "
                           f"({LAYERS[lb][0]}), a higher layer")
    assert not bad, "imports against the layering of ARCHITECTURE.md:\n" + "\n".join(bad)


def test_the_graph_sees_imports_inside_functions():
    """The walker itself: a deferred import and a relative one are edges like a top-level one."""
    src = "def f():\n    from crr.sandbox import checkout\n    import crr.tasks.schema\nfrom . import base\n"
    path = ROOT / "sandbox" / "_probe.py"
    found = {m for _, m in imports(path, module_name(path), set(modules()), source=src)}
    assert {"crr.sandbox.checkout", "crr.tasks.schema", "crr.sandbox.base"} <= found
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 1}}) == [["a", "b", "c", "a"]]


# ------------------------------------------------------------------ the extension points of ARCHITECTURE.md

def test_a_new_advantage_estimator_is_selectable_by_name():
    from crr.train.advantages import ESTIMATORS, RowCredit, estimate

    def constant(rows):  # ARCHITECTURE.md's lines
        return [[0.5] * len(r.spans) for r in rows]

    ESTIMATORS["constant"] = constant
    try:
        rows = [RowCredit(group_key=0, reward=1.0, spans=[(0, 2), (3, 4)]),
                RowCredit(group_key=0, reward=0.0, spans=[(0, 1)])]
        assert estimate("constant", rows) == [[0.5, 0.5], [0.5]]
    finally:
        del ESTIMATORS["constant"]


def test_a_new_fork_engine_is_returned_by_get_engine():
    from crr.sandbox import ENGINES, get_engine, register_engine

    class ToyEngine:  # the protocol is crr.sandbox.base.ForkEngine; get_engine only constructs it
        name = "toy"

        def __init__(self, **opts):
            self.opts = opts

    register_engine("toy", ToyEngine)
    try:
        engine = get_engine("toy", workers=3)
        assert isinstance(engine, ToyEngine) and engine.opts == {"workers": 3}
        assert "toy" in ENGINES
    finally:
        del ENGINES["toy"]


def test_a_new_task_source_materialises_the_repository_of_a_row_that_carries_its_key(tmp_path, monkeypatch):
    import dataclasses
    import subprocess

    from crr.sandbox.checkout import base_checkout
    from crr.tasks.sources import SOURCES, register_source
    from crr.tasks.schema import Task

    monkeypatch.setenv("CRR_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "toy-repo"
    repo.mkdir()
    (repo / "hello.py").write_text("print('hi')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "toy"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    made = []

    def from_toy_store(task):  # ARCHITECTURE.md's lines: a path to a git repository or bundle
        made.append(task.instance_id)
        return repo

    register_source("toy_store", lambda task: "toy_store" in task.metadata, from_toy_store)
    try:
        task = Task(instance_id="toy-1", repo="toy/toy", base_commit=commit, problem_statement="p", patch="",
                    test_patch="", FAIL_TO_PASS=("t",), PASS_TO_PASS=(), version="0",
                    metadata={"toy_store": "anything"})
        checkout = base_checkout(task)
        assert made == ["toy-1"] and (checkout / "hello.py").read_text() == "print('hi')\n"
        with pytest.raises(Exception, match="cannot be checked out"):
            base_checkout(dataclasses.replace(task, instance_id="toy-2", metadata={}))
    finally:
        del SOURCES["toy_store"]
