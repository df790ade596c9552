"""Evaluate a generated package's test cases against the correct code and candidate mutants.

Run as `python -m crr.tasks.probe` in a fresh process (the micro generator does), reading a JSON
request on stdin and writing a JSON answer on stdout. A fresh process because mutants may raise,
loop or allocate without bound: each case runs under an alarm and an address-space limit, and
nothing a mutant does can reach the generator. Expected values are computed here too, so one
process sees one interpreter state (hash seed, float formatting) for the reference and the mutants.

Request: {"root": dir holding the package, "package": name,
          "cases": [{"module", "function", "args"}...],   # args: Python source of the call's arguments
          "mutants": [{"file": path under root, "source": text}...], "probe_cases": [case indices]}
Answer:  {"reference": [{"value": repr} | {"raises": ExcName} | {"error": why unusable}...],
          "mutants": [{"revealing": [case index...], "observed": {index: text}, "timeout": bool}...]}
"""

from __future__ import annotations

import importlib
import json
import math
import resource
import signal
import sys
from pathlib import Path

CASE_TIMEOUT_S = 2.0
MEMORY_LIMIT = 2 << 30


class _Timeout(BaseException):
    """BaseException so that a mutant's `except Exception` cannot swallow it."""


def _alarm(signum, frame):
    raise _Timeout()


def _call(package: str, case: dict):
    module = importlib.import_module(f"{package}.{case['module']}")
    fn = getattr(module, case["function"])
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    try:
        return eval(f"__fn({case['args']})", {"__fn": fn})  # our own literal arguments
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _fresh_import(package: str) -> None:
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _outcome(package: str, case: dict) -> tuple[str, object]:
    try:
        return "value", _call(package, case)
    except _Timeout:
        return "timeout", None
    except Exception as e:  # noqa: BLE001 - a raised exception is an observable behaviour
        return "raises", e


def _same(ref: tuple[str, object], out: tuple[str, object]) -> bool:
    """What the generated test asserts: `== expected` (pytest.approx for floats) or pytest.raises."""
    if ref[0] == "raises":
        return out[0] == "raises" and isinstance(out[1], type(ref[1]))
    if out[0] != "value":
        return False
    expected, got = ref[1], out[1]
    try:
        if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
            return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12)
        return bool(got == expected)
    except Exception:  # noqa: BLE001
        return False


def _describe(out: tuple[str, object]) -> str:
    if out[0] == "raises":
        return f"raises {type(out[1]).__name__}: {out[1]}"
    if out[0] == "timeout":
        return "never returns"
    return f"returns {out[1]!r}"


def main() -> None:
    request = json.load(sys.stdin)
    sys.dont_write_bytecode = True
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _alarm)
    root, package, cases = Path(request["root"]), request["package"], request["cases"]
    sys.path.insert(0, str(root))

    _fresh_import(package)
    reference = [_outcome(package, c) for c in cases]
    answer: dict = {"reference": [], "mutants": []}
    for kind, value in reference:
        if kind == "raises":
            answer["reference"].append({"raises": type(value).__name__})
        elif kind == "value" and _round_trips(value):
            answer["reference"].append({"value": repr(value)})
        else:
            answer["reference"].append({"error": f"{kind}: {value!r}"[:200]})

    for mutant in request["mutants"]:
        path = root / mutant["file"]
        original = path.read_text()
        path.write_text(mutant["source"])
        _fresh_import(package)
        revealing, observed, timeout = [], {}, False
        try:
            for i in request["probe_cases"]:
                out = _outcome(package, cases[i])
                timeout = timeout or out[0] == "timeout"
                if not _same(reference[i], out):
                    revealing.append(i)
                    observed[str(i)] = _describe(out)[:300]
        finally:
            path.write_text(original)
        answer["mutants"].append({"revealing": revealing, "observed": observed, "timeout": timeout})
    json.dump(answer, sys.stdout)


def _round_trips(value: object) -> bool:
    """The generated test embeds repr(value) as a literal, so it has to evaluate back to value."""
    try:
        return eval(repr(value), {}) == value  # our own values
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    main()
