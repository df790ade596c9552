"""The embedded tokenizer-training corpus: text shaped like what the policy reads and writes.

No hub is reachable, so the default model's tokenizer is trained offline on text generated here:
chat transcripts rendered with the model's own chat template (system prompt, tool catalogue, issues,
tool calls, tool responses), Python source typical of small packages, pytest output and unified
diffs. It is generated from a seeded RNG, so the same seed gives the same corpus and tokenizer.
"""

from __future__ import annotations

import json
import keyword
import random
from collections.abc import Iterator

from transformers.utils.chat_template_utils import render_jinja_template

from crr.agent.prompt import SYSTEM_PROMPT, TOOL_SCHEMAS

# A word bank of English and programming vocabulary, so the tokenizer learns pieces for the issue text,
# identifiers and docstrings of real tasks rather than only this generator's templates.
_WORDS = """
value values items item result results path paths name names data count counts index indices total key
keys text line lines token tokens config configuration options option cache buffer width height size
start end offset limit parser parse record records entry entries column columns row rows header headers
payload message messages status level score weight factor amount price unit units rate step steps node
nodes edge edges graph tree queue stack window chunk batch user users order orders report reports file
files directory folder module modules package packages function functions method methods class classes
object objects instance attribute attributes argument arguments parameter parameters default defaults
return returns raise raises error errors exception exceptions warning warnings test tests suite case
cases fixture fixtures assert expected actual output input inputs outputs format formats string strings
number numbers integer float boolean list lists dict dictionary tuple set sets array arrays matrix vector
field fields schema type types typed annotation version versions release build install dependency
dependencies import imports export source target origin destination request response client server
session connection socket port host address url query filter filters sort sorted search find match
matches pattern regex replace split join strip encode decode encoding decoding unicode ascii bytes byte
char character characters word words sentence paragraph document documents page pages title body
description summary comment comments note notes issue issues bug bugs fix fixed fixes patch patches
change changes commit commits branch merge diff review feature features support supported behaviour
behavior regression crash crashes fails failing failure failures passes passing success successful
empty missing invalid valid validate validation check checks checked verify ensure handle handler
handlers event events callback callbacks hook hooks signal signals thread threads process processes
task tasks job jobs worker workers pool timeout retry retries delay interval timer clock time date
datetime timezone zone year month day hour minute second seconds milliseconds duration period epoch
local global scope context manager registry factory builder adapter wrapper proxy decorator property
properties setter getter iterator generator sequence mapping collection container element elements
first last next previous current new old initial final minimum maximum min max sum mean median average
round floor ceil absolute ratio percent percentage precision tolerance epsilon scale scaled normalize
normalized convert conversion compute calculate calculation estimate approximate exact equal equals
greater less compare comparison difference distance angle radius area volume length point points shape
shapes circle square rectangle polygon triangle line segment coordinate coordinates position location
currency money balance account accounts transaction transactions ledger invoice customer product
products inventory stock quantity discount tax total subtotal shipping address email phone contact
config settings environment variable variables flag flags option verbose debug quiet logging logger log
logs trace traceback stack frame line number memory disk storage database table tables query queries
index primary foreign unique constraint migration model models view views template templates render
rendering layout style theme color colour font image images icon button form forms widget menu
command commands shell terminal script scripts run running runner execute execution exit code codes
standard stream pipe redirect argument parser subcommand usage help manual documentation docs readme
license author authors maintainer contributors project repository upstream downstream library framework
python pytest unittest mock patch monkeypatch tmp_path capsys parametrize mark skip xfail raises approx
numpy pandas requests json yaml toml csv xml html http https api rest endpoint route routes router
cli main setup init init_ teardown helper helpers util utils common core base abstract interface
protocol implementation implement implements override overrides inherit inherits subclass superclass
instance static dynamic lazy eager async await sync synchronous asynchronous concurrent parallel serial
serialize deserialize dump dumps load loads read write reads writes open close closed opened save
saved delete deleted remove removed insert inserted append appended extend update updated create
created copy copied move moved rename renamed exists contains include includes exclude excludes ignore
ignored allow allowed deny denied enable enabled disable disabled visible hidden public private
internal external optional required mandatory deprecated legacy compatible compatibility breaking
should would could must might cannot instead because when while where which whether before after
during without within between against about above below under over into onto from with this that
these those there here other another same different each every all any some none nothing something
always never often sometimes usually currently previously correctly incorrectly properly silently
unexpectedly wrong right bad good better best worse worst simple complex small large big tiny huge
long short high low fast slow quickly slowly easy hard possible impossible likely unlikely also only
just even still already yet again once twice however therefore otherwise although though since until
the a an and or not but if else elif for in is are was were be been being has have had do does did
done can will shall may of to on at by as it its they them their we our you your he she his her
reproduce reproduction steps expected behaviour actual traceback environment platform linux windows
macos operating system install installed upgrade downgrade pinned workaround suggestion proposal
""".split()  # noqa: SIM905 (a word bank reads best as text)
_NAMES = [w for w in _WORDS if w.isidentifier() and not keyword.iskeyword(w)]  # usable as identifiers
_PACKAGES = ("calc", "textkit", "datefmt", "minijson", "shapes", "inventory", "ledger", "units", "tabular", "geom")
_MODULES = ("core", "utils", "parser", "config", "models", "io", "cli", "helpers", "stats", "render", "format",
            "convert")
_ERRORS = ("ValueError", "TypeError", "KeyError", "IndexError", "AssertionError", "ZeroDivisionError",
           "AttributeError")
_OPS = ("+", "-", "*", "//", "%")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 16))]
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", ":"])


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 8)))


def _ident(rng: random.Random, parts: int = 2) -> str:
    return "_".join(rng.choice(_NAMES) for _ in range(rng.randint(1, parts)))


def _path(rng: random.Random) -> str:
    pkg = rng.choice(_PACKAGES)
    if rng.random() < 0.3:
        return f"tests/test_{rng.choice(_MODULES)}.py"
    return f"{pkg}/{rng.choice(_MODULES)}.py"


def _function(rng: random.Random) -> str:
    name, a, b = _ident(rng), rng.choice(_NAMES), rng.choice(_NAMES)
    op, n = rng.choice(_OPS), rng.randint(0, 100)
    body = rng.choice([
        (f"    if {a} is None:\n        raise {rng.choice(_ERRORS)}(\"{a} must be set\")\n"
         f"    return {a} {op} {b}\n"),
        (f"    {name}_out = []\n    for {a}_i in {a}:\n        if {a}_i > {n}:\n"
         f"            {name}_out.append({a}_i {op} {b})\n    return {name}_out\n"),
        (f"    total = 0\n    for i in range(len({a})):\n        total += {a}[i] {op} {n}\n"
         f"    return total / max(len({a}), 1)\n"),
        f"    return {{k: v for k, v in {a}.items() if v != {b}}}\n",
        f"    with open({a}) as f:\n        return [line.strip() for line in f if line.strip()]\n",
    ])
    doc = f'    """{_sentence(rng)}"""\n' if rng.random() < 0.6 else ""
    return f"def {name}({a}, {b}={n}):\n{doc}{body}"


def _class(rng: random.Random) -> str:
    cls = "".join(w.capitalize() for w in _ident(rng).split("_"))
    fields = rng.sample(_NAMES, 3)
    init = "".join(f"        self.{f} = {f}\n" for f in fields)
    return (f"class {cls}:\n    def __init__(self, {', '.join(fields)}):\n{init}\n"
            f"    def __repr__(self):\n        return f\"{cls}({fields[0]}={{self.{fields[0]}!r}})\"\n")


def _source(rng: random.Random) -> str:
    imports = rng.sample(["import os", "import re", "import json", "import math", "from pathlib import Path",
                          "from dataclasses import dataclass", "import pytest"], 2)
    parts = [_function(rng) if rng.random() < 0.7 else _class(rng) for _ in range(rng.randint(2, 4))]
    return "\n".join(imports) + "\n\n\n" + "\n\n".join(parts)


def _test_source(rng: random.Random) -> str:
    mod, fn = rng.choice(_MODULES), _ident(rng)
    return (f"from {rng.choice(_PACKAGES)}.{mod} import {fn}\n\n\n"
            f"def test_{fn}():\n    assert {fn}({rng.randint(0, 9)}, {rng.randint(0, 9)}) == {rng.randint(0, 99)}\n\n\n"
            f"def test_{fn}_rejects_none():\n    with pytest.raises({rng.choice(_ERRORS)}):\n        {fn}(None)\n")


def _numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:>4}\t{line}" for i, line in enumerate(text.splitlines(), start))


def _pytest_output(rng: random.Random) -> str:
    test, n_pass, n_fail = _path(rng), rng.randint(0, 30), rng.randint(0, 3)
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0",
             f"rootdir: /repo\ncollected {n_pass + n_fail} items\n",
             f"{test} {'.' * n_pass}{'F' * n_fail}  [100%]"]
    if n_fail:
        err, fn = rng.choice(_ERRORS), _ident(rng)
        lines += ["\n=================================== FAILURES ===================================",
                  f"________________________________ test_{fn} ________________________________",
                  f"\n    def test_{fn}():\n>       assert {fn}({rng.randint(0, 9)}) == {rng.randint(0, 9)}",
                  f"E       {err}: assert {rng.randint(0, 99)} == {rng.randint(0, 99)}",
                  f"\n{test}:{rng.randint(3, 80)}: {err}",
                  "=========================== short test summary info ============================",
                  f"FAILED {test}::test_{fn} - {err}"]
    summary = ", ".join(s for s in (f"{n_fail} failed" if n_fail else "", f"{n_pass} passed") if s)
    lines.append(f"========================= {summary} in {rng.random():.2f}s =========================")
    return "\n".join(lines)


def _diff(rng: random.Random) -> str:
    path, start = _path(rng), rng.randint(1, 120)
    old, new = _function(rng).splitlines()[:3], _function(rng).splitlines()[:3]
    return (f"--- a/{path}\n+++ b/{path}\n@@ -{start},3 +{start},3 @@\n"
            + "".join(f"-{line}\n" for line in old) + "".join(f"+{line}\n" for line in new))


def _tool_call(rng: random.Random) -> tuple[dict, str]:
    """One call in OpenAI message format and a plausible observation for it."""
    name = rng.choice([t["function"]["name"] for t in TOOL_SCHEMAS])
    path = _path(rng)
    if name == "view_file":
        start = rng.randint(1, 60)
        args, obs = {"path": path, "start": start, "end": start + rng.randint(10, 120)}, _numbered(_source(rng), start)
    elif name == "edit_file":
        start = rng.randint(1, 60)
        args = {"path": path, "start": start, "end": start + rng.randint(0, 4), "replacement": _function(rng)}
        obs = _diff(rng)
    elif name == "run_shell":
        cmd = rng.choice([f"grep -rn {_ident(rng)} {rng.choice(_PACKAGES)}", "ls -la", "git status",
                          f"cat {path}", f"python -c 'import {rng.choice(_PACKAGES)}'", "git diff"])
        args, obs = ({"command": cmd, "timeout": rng.choice([10, 30, 60, 120])},
                     f"$ {cmd}\n{_source(rng)[:200]}\n[exit 0]")
    elif name == "run_tests":
        args, obs = ({"test_filter": rng.choice(["", f"{path}::test_{_ident(rng)}", f"-k {_ident(rng)}"])},
                     _pytest_output(rng))
    else:
        args, obs = {}, "Patch submitted."
    return {"type": "function", "function": {"name": name, "arguments": args}}, obs


def _issue(rng: random.Random) -> str:
    fn, pkg = _ident(rng), rng.choice(_PACKAGES)
    return (f"Repository: {pkg}\nWorking directory: /repo (the repository root; tool paths are relative to it)\n\n"
            f"Issue title: {fn}() returns the wrong {rng.choice(_WORDS)} for empty input\n\n"
            f"Issue body:\nCalling `{fn}([])` raises {rng.choice(_ERRORS)} instead of returning "
            f"{rng.randint(0, 9)}. {_prose(rng)}\n")


def _transcript(rng: random.Random, chat_template: str) -> str:
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _issue(rng)}]
    for _ in range(rng.randint(1, 5)):
        call, obs = _tool_call(rng)
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": call["function"]["name"], "content": obs})
    rendered, _ = render_jinja_template([messages], tools=TOOL_SCHEMAS, chat_template=chat_template)
    return rendered[0]


def corpus(chat_template: str, seed: int = 0, n_docs: int = 3000) -> Iterator[str]:
    """Documents for tokenizer training; about a tenth are full chat transcripts."""
    rng = random.Random(seed)
    yield SYSTEM_PROMPT
    yield json.dumps(TOOL_SCHEMAS)
    makers = (_source, _test_source, _pytest_output, _diff, _prose)
    for i in range(n_docs):
        yield _transcript(rng, chat_template) if i % 10 == 0 else rng.choice(makers)(rng)
