"""Bug families for the micro task set, injected as AST transforms.

Why the `ast` module: a mutation site must be an exact syntactic construct (a `<=` in a comparison,
an `elif` branch, a call's argument list), never a look-alike inside a string or a comment, which
regex edits on text cannot guarantee. Each mutant is realised as a minimal text edit (only the
mutated expression or the removed lines change, so the gold patch is a small, natural diff) and is
verified by re-parsing: the edited text must parse to exactly the mutated tree.
"""

from __future__ import annotations

import ast
import copy
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# name -> how hard the bug is to localise and fix (0-2), used for the difficulty tier
FAMILIES: dict[str, int] = {
    "operator_swap": 0,       # a + b  -> a - b,  and -> or,  += -> -=
    "wrong_constant": 0,      # 0.1 -> 0.2, 2 -> 3
    "wrong_function": 0,      # min -> max, any -> all, .lower() -> .upper()
    "off_by_one": 1,          # < -> <=, range(n) -> range(n - 1), [:k] -> [:k + 1]
    "negated_condition": 1,   # if c: -> if not c:,  == -> !=
    "swapped_arguments": 1,   # f(a, b) -> f(b, a),  a - b -> b - a
    "wrong_variable": 2,      # a local used in place of another
    "missing_branch": 2,      # a guard, an elif or an else removed
}

_OP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
            ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv}
_BOOL_SWAP = {ast.And: ast.Or, ast.Or: ast.And}
_STRICT_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_NEGATE_OP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
              ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_FUNC_SWAP = {"min": "max", "max": "min", "any": "all", "all": "any"}
_METHOD_SWAP = {"lower": "upper", "upper": "lower", "startswith": "endswith", "endswith": "startswith",
                "lstrip": "rstrip", "rstrip": "lstrip", "floor": "ceil", "ceil": "floor"}
_NONCOMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


@dataclass(frozen=True)
class Mutant:
    family: str
    function: str     # the function holding the bug
    lineno: int
    description: str  # for logs and debugging, never shown to the agent
    source: str       # the whole mutated module


def mutants(source: str, family: str, rng: random.Random) -> list[Mutant]:
    """Every valid mutant of `family` inside the functions of `source`, in source order."""
    return list(iter_mutants(source, family, rng))


def iter_mutants(source: str, family: str, rng: random.Random) -> Iterator[Mutant]:
    if family not in FAMILIES:
        raise ValueError(f"unknown bug family {family!r}; known: {sorted(FAMILIES)}")
    tree = ast.parse(source)
    for func in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for edit in _SITES[family](func, rng):
            mutated = _realise(source, tree, edit)
            if mutated is not None:
                yield Mutant(family, func.name, edit.lineno, edit.description, mutated)


# ------------------------------------------------------------------ edits and their verification

@dataclass
class _Edit:
    description: str
    lineno: int
    target: ast.AST                    # node replaced, or statement removed
    replacement: ast.AST | None = None  # expression-level: the new node
    drop_lines: tuple[int, int] | None = None  # statement-level: 1-based inclusive line range
    apply_tree: Callable[[ast.AST, ast.AST], None] | None = None  # statement-level: (tree copy, target copy)


def _realise(source: str, tree: ast.Module, edit: _Edit) -> str | None:
    expected = _expected_tree(tree, edit)
    if edit.replacement is not None:
        new = ast.unparse(edit.replacement)
        candidates = [_replace_segment(source, edit.target, new), _replace_segment(source, edit.target, f"({new})")]
    else:
        lines = source.splitlines(keepends=True)
        first, last = edit.drop_lines
        candidates = ["".join(lines[:first - 1] + lines[last:])]
    for text in candidates:
        try:
            if ast.dump(ast.parse(text)) == expected:
                return text
        except SyntaxError:
            continue
    return None


def _expected_tree(tree: ast.Module, edit: _Edit) -> str:
    nodes = list(ast.walk(tree))
    clone = copy.deepcopy(tree)
    twin = list(ast.walk(clone))[nodes.index(edit.target)]
    if edit.replacement is not None:
        _swap_child(clone, twin, copy.deepcopy(edit.replacement))
    else:
        edit.apply_tree(clone, twin)
    return ast.dump(clone)


def _swap_child(root: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(root):
        for name, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, name, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[next(i for i, v in enumerate(value) if v is old)] = new
                return
    raise AssertionError("node not found in its tree")


def _replace_segment(source: str, node: ast.AST, new: str) -> str:
    # ast offsets are UTF-8 byte columns
    lines = source.encode().splitlines(keepends=True)
    start = sum(map(len, lines[:node.lineno - 1])) + node.col_offset
    end = sum(map(len, lines[:node.end_lineno - 1])) + node.end_col_offset
    data = source.encode()
    return (data[:start] + new.encode() + data[end:]).decode()


# ------------------------------------------------------------------ where each family can strike

def _body_nodes(func: ast.FunctionDef) -> Iterator[ast.AST]:
    """Nodes of the function body, skipping its docstring, f-strings and raise statements (a bug
    in an error message is not a behaviour change tests reveal)."""
    body = func.body[1:] if _is_docstring(func.body[0]) else func.body
    stack = list(reversed(body)) + list(func.args.defaults)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            continue
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _operator_swap(func, rng):
    for node in _body_nodes(func):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _OP_SWAP:
            new = copy.deepcopy(node)
            new.op = _OP_SWAP[type(node.op)]()
            yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = _BOOL_SWAP[type(node.op)]()
            yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)


def _plus(node: ast.expr, delta: int) -> ast.expr:
    return ast.BinOp(copy.deepcopy(node), ast.Add() if delta > 0 else ast.Sub(), ast.Constant(abs(delta)))


def _off_by_one(func, rng):
    for node in _body_nodes(func):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _STRICT_SWAP:
                    new = copy.deepcopy(node)
                    new.ops[i] = _STRICT_SWAP[type(op)]()
                    yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
              and node.args and not any(isinstance(a, ast.Starred) for a in node.args)):
            stop = 0 if len(node.args) == 1 else 1
            new = copy.deepcopy(node)
            new.args[stop] = _plus(node.args[stop], rng.choice((1, -1)))
            yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)
        elif isinstance(node, ast.Slice):
            for bound in ("lower", "upper"):
                if getattr(node, bound) is not None:
                    new = copy.deepcopy(node)
                    setattr(new, bound, _plus(getattr(node, bound), rng.choice((1, -1))))
                    yield _Edit(f"slice {bound} {_src(getattr(node, bound))} -> {_src(getattr(new, bound))}",
                                node.lineno, getattr(node, bound), getattr(new, bound))


def _wrong_variable(func, rng):
    params = [a.arg for a in func.args.posonlyargs + func.args.args + func.args.kwonlyargs]
    first_store: dict[str, int] = {}
    for node in _body_nodes(func):
        if isinstance(node, ast.comprehension):
            continue  # comprehension targets are not visible outside their comprehension
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            first_store.setdefault(node.id, node.lineno)
    comp_targets = {n.id for c in ast.walk(func) if isinstance(c, ast.comprehension)
                    for n in ast.walk(c.target) if isinstance(n, ast.Name)}
    first_store = {k: v for k, v in first_store.items() if k not in comp_targets}
    called = {id(n.func) for n in ast.walk(func) if isinstance(n, ast.Call)}
    for node in _body_nodes(func):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)) or id(node) in called:
            continue
        if node.id not in params and node.id not in first_store:
            continue
        # only names certainly bound at this point: parameters and locals assigned on an earlier line
        others = [n for n in params if n != node.id] + sorted(
            n for n, line in first_store.items() if line < node.lineno and n != node.id and n not in params)
        if others:
            new = ast.Name(rng.choice(others), ast.Load())
            yield _Edit(f"{node.id} -> {new.id}", node.lineno, node, new)


def _negate(test: ast.expr) -> ast.expr:
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return copy.deepcopy(test.operand)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _NEGATE_OP:
        new = copy.deepcopy(test)
        new.ops = [_NEGATE_OP[type(test.ops[0])]()]
        return new
    return ast.UnaryOp(ast.Not(), copy.deepcopy(test))


def _negated_condition(func, rng):
    for node in _body_nodes(func):
        tests = []
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        elif isinstance(node, ast.Return) and isinstance(node.value, (ast.Compare, ast.BoolOp)):
            tests = [node.value]
        for test in tests:
            new = _negate(test)
            yield _Edit(f"{_src(test)} -> {_src(new)}", test.lineno, test, new)


def _wrong_constant(func, rng):
    for node in _body_nodes(func):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
            if isinstance(value, int):
                new_value = value + 1 if abs(value) <= 10 else value * 2
            else:
                new_value = value * 2 if value else 1.0
            yield _Edit(f"{value!r} -> {new_value!r}", node.lineno, node, ast.Constant(new_value))


def _missing_branch(func, rng):
    for parent in [func, *_body_nodes(func)]:
        for field in ("body", "orelse"):
            stmts = getattr(parent, field, None)
            if not isinstance(stmts, list):
                continue
            kept = [s for s in stmts if not _is_docstring(s)]
            for stmt in stmts:
                if not isinstance(stmt, ast.If):
                    continue
                if not stmt.orelse and len(kept) > 1:  # a guard: the block still does something without it
                    yield _Edit(f"guard `if {_src(stmt.test)}` removed", stmt.lineno, stmt,
                                drop_lines=(stmt.lineno, stmt.end_lineno), apply_tree=_remove_stmt)
                elif stmt.orelse:
                    yield from _drop_orelse(stmt)


def _remove_stmt(root: ast.AST, twin: ast.AST) -> None:
    for parent in ast.walk(root):
        for _, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is twin for v in value):
                value[:] = [v for v in value if v is not twin]
                return


def _drop_orelse(stmt: ast.If):
    first = stmt.orelse[0]
    if len(stmt.orelse) == 1 and isinstance(first, ast.If) and first.lineno != stmt.lineno:
        # an `elif` (its own If node): drop that branch and keep the ones after it
        if first.orelse:
            nxt = first.orelse[0]
            end = (nxt.lineno if isinstance(nxt, ast.If) and len(first.orelse) == 1 else _else_line(first)) - 1
        else:
            end = first.end_lineno
        yield _Edit(f"branch `elif {_src(first.test)}` removed", first.lineno, stmt,
                    drop_lines=(first.lineno, end),
                    apply_tree=lambda _, twin: setattr(twin, "orelse", twin.orelse[0].orelse))
    else:
        start = _else_line(stmt)
        yield _Edit("`else` branch removed", start, stmt, drop_lines=(start, stmt.end_lineno),
                    apply_tree=lambda _, twin: setattr(twin, "orelse", []))


def _else_line(stmt: ast.If) -> int:
    # the `else:` keyword has no node; it sits on the line before its first statement (the
    # re-parse check rejects the edit if the code is laid out otherwise)
    return stmt.orelse[0].lineno - 1


def _wrong_function(func, rng):
    for node in _body_nodes(func):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in _FUNC_SWAP:
            new = ast.Name(_FUNC_SWAP[f.id], ast.Load())
            yield _Edit(f"{f.id}() -> {new.id}()", node.lineno, f, new)
        elif isinstance(f, ast.Attribute) and f.attr in _METHOD_SWAP:
            new = copy.deepcopy(f)
            new.attr = _METHOD_SWAP[f.attr]
            yield _Edit(f".{f.attr}() -> .{new.attr}()", node.lineno, f, new)


def _swapped_arguments(func, rng):
    for node in _body_nodes(func):
        if (isinstance(node, ast.Call) and len(node.args) >= 2
                and not any(isinstance(a, ast.Starred) for a in node.args[:2])
                and _src(node.args[0]) != _src(node.args[1])):
            new = copy.deepcopy(node)
            new.args[0], new.args[1] = new.args[1], new.args[0]
            yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, _NONCOMMUTATIVE)
              and _src(node.left) != _src(node.right)):
            new = ast.BinOp(copy.deepcopy(node.right), node.op, copy.deepcopy(node.left))
            yield _Edit(f"{_src(node)} -> {_src(new)}", node.lineno, node, new)


_SITES = {
    "operator_swap": _operator_swap, "off_by_one": _off_by_one, "wrong_variable": _wrong_variable,
    "negated_condition": _negated_condition, "wrong_constant": _wrong_constant,
    "missing_branch": _missing_branch, "wrong_function": _wrong_function,
    "swapped_arguments": _swapped_arguments,
}
assert set(_SITES) == set(FAMILIES)
