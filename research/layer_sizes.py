"""The size of crr's layers (issue 13's figures): lines per layer as tests/test_architecture.py assigns modules to
layers, the largest files, the longest functions, and each CLI command's body (lines after its docstring).

    .venv/bin/python research/layer_sizes.py
"""

from __future__ import annotations

import ast
import importlib.util
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "tests" / "test_architecture.py")
    arch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(arch)
    per_layer, files, functions, commands = Counter(), [], [], []
    for path in sorted((ROOT / "crr").rglob("*.py")):
        text, rel = path.read_text(), path.relative_to(ROOT)
        per_layer[arch.LAYERS[arch.layer_of(path)][0]] += len(text.splitlines())
        files.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(tree := ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
        if rel.parts[:2] == ("crr", "cli"):
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.endswith("_command"):
                    body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body
                    commands.append((node.end_lineno - body[0].lineno + 1, f"{rel}:{node.name}"))
    print("lines per layer:", ", ".join(f"{name} {n:,}" for name, n in per_layer.items()),
          f"(total {sum(per_layer.values()):,})")
    print("largest files:", ", ".join(f"{f} {n}" for n, f in sorted(files)[-3:][::-1]))
    print("longest functions:", ", ".join(f"{f} {n}" for n, f in sorted(functions)[-3:][::-1]))
    commands.sort()
    print(f"command bodies ({len(commands)} *_command functions): median {commands[len(commands) // 2][0]} lines, "
          "longest " + ", ".join(f"{f} {n}" for n, f in commands[-3:][::-1]))


if __name__ == "__main__":
    main()
