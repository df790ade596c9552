"""The five SWE tools (paper: Appendix "Prompt and Tool Catalogue"), tool-call parsing, and the
tool-type score of the decision-point selector (paper: Method, "Decision-Point Selector").

    obs = execute(sandbox, '<tool_call>{"name": "view_file", "arguments": {"path": "a.py"}}</tool_call>')

Every action is one stateless command in the sandbox (no shell session survives between actions),
so an observation depends only on the sandbox's file system and the call (plus whatever a command
prints that varies by itself, such as pytest's timings): identical states give identical
observations. A bad call (bad JSON, unknown tool, wrong arguments, a path outside the
repository, a line range out of bounds) yields an error observation the model can read and never
raises; infrastructure failures (SandboxError) propagate, because they are not the agent's doing.

Semantics of edit_file (1-based, inclusive line ranges):
  replace  start <= end <= number of lines: lines start..end become `replacement`;
  insert   end = start - 1: `replacement` goes before line `start` (start = lines + 1 appends);
  delete   replacement = "";
  new file start = 1, end = 0 on a path that does not exist (parent directories are created).
A non-empty replacement gets a final newline if it lacks one. Lines are split on "\\n" only, so
view_file's numbers are exactly the ones edit_file uses. view_file shows at most VIEW_WINDOW_LINES
lines and clamps `end` to the file; a `start` past the end is an error.
"""

from __future__ import annotations

import difflib
import json
import posixpath
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from crr.agent.prompt import DEFAULT_SHELL_TIMEOUT_S, TOOL_NAMES, TOOL_SCHEMAS, VIEW_WINDOW_LINES
from crr.errors import CRRError, SandboxError
from crr.sandbox.base import SCRATCH_DIR, ExecResult, Sandbox  # SCRATCH_DIR: also crr.agent.tools.SCRATCH_DIR

OBS_KEEP_CHARS = 4000     # an observation keeps its first and last this many characters
TEST_TIMEOUT_S = 300      # run_tests: the canonical runner gets this long


class ToolCallError(CRRError):
    """The model's tool call is malformed; the message is short and meant for the model to read."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)

    def canonical(self) -> str:
        """One JSON text per action (sorted keys, schema defaults filled in): equal iff same action."""
        args = {**_DEFAULTS.get(self.name, {}), **self.arguments}
        return json.dumps({"name": self.name, "arguments": args}, sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))


@dataclass(frozen=True)
class Observation:
    text: str
    is_error: bool = False   # the call was rejected (invalid); a failing command is not an error
    terminal: bool = False   # submit_patch: the episode ends


_PARAMS: dict[str, dict] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
_DEFAULTS: dict[str, dict] = {name: {k: p["default"] for k, p in params["properties"].items()
                                     if "default" in p} for name, params in _PARAMS.items()}
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


# ----------------------------------------------------------------------------- parsing

def parse_tool_call(text: str) -> ToolCall:
    """A JSON object {"name": ..., "arguments": {...}}, bare or in <tool_call>...</tool_call>
    (Qwen/Hermes); text outside the block (e.g. reasoning) is ignored. Raises ToolCallError."""
    blocks = _TOOL_CALL_BLOCK.findall(text)
    if len(blocks) > 1:
        raise ToolCallError(f"found {len(blocks)} tool calls; emit exactly one per turn")
    body = (blocks[0] if blocks else text).strip()
    if not body:
        raise ToolCallError('empty tool call; emit {"name": ..., "arguments": {...}}')
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from None
    if not isinstance(obj, dict):
        raise ToolCallError(f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
                            f"got {_json_type(obj)}")
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        raise ToolCallError(f"unexpected key(s) {extra} in the tool call; use only 'name' and 'arguments'")
    if not isinstance(obj.get("name"), str):
        raise ToolCallError("the tool call needs a 'name' string")
    call = ToolCall(obj["name"], obj.get("arguments", {}))
    validate(call)
    return call


def script_calls(text: str) -> list[str]:
    """The calls of a script: a JSON list of call objects, else one call per line (JSONL). Each stays
    text, so a malformed one becomes an error observation rather than stopping the script."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return [line for line in text.splitlines() if line.strip()]
    if isinstance(items, list):
        return [json.dumps(item) for item in items]
    return [text]


def validate(call: ToolCall) -> None:
    """Check a call against TOOL_SCHEMAS (the small JSON-schema subset they use); ToolCallError if not.

    Hand-written because jsonschema is not a dependency and its messages are long for a model."""
    if call.name not in _PARAMS:
        raise ToolCallError(f"unknown tool {call.name!r}; the tools are {', '.join(TOOL_NAMES)}")
    if not isinstance(call.arguments, dict):
        raise ToolCallError(f"'arguments' must be a JSON object, got {_json_type(call.arguments)}")
    params = _PARAMS[call.name]
    props = params["properties"]
    extra = sorted(set(call.arguments) - set(props))
    if extra:
        takes = ", ".join(props) or "no arguments"
        raise ToolCallError(f"unexpected argument(s) {extra} for {call.name}; it takes {takes}")
    missing = [k for k in params["required"] if k not in call.arguments]
    if missing:
        raise ToolCallError(f"missing required argument(s) {missing} for {call.name}")
    for key, value in call.arguments.items():
        spec = props[key]
        ok = isinstance(value, str) if spec["type"] == "string" else \
            isinstance(value, int) and not isinstance(value, bool)
        if not ok:
            raise ToolCallError(f"argument '{key}' of {call.name} must be {_A[spec['type']]}, "
                                f"got {_json_type(value)}")
        if "minimum" in spec and value < spec["minimum"]:
            raise ToolCallError(f"argument '{key}' of {call.name} must be >= {spec['minimum']}, got {value}")
        if "maximum" in spec and value > spec["maximum"]:
            raise ToolCallError(f"argument '{key}' of {call.name} must be <= {spec['maximum']}, got {value}")
        if isinstance(value, str) and not _is_text(value):  # JSON can encode both; files and argv cannot
            raise ToolCallError(f"argument '{key}' of {call.name} contains a NUL or an unpaired surrogate")


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\0" not in value


_A = {"string": "a string", "integer": "an integer"}


def _json_type(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- observations

def truncate(text: str, keep: int = OBS_KEEP_CHARS) -> str:
    """First and last `keep` characters with a marker between: deterministic and bounded."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters elided ...]\n{text[-keep:]}"


# Wall-clock durations a test runner prints ("5 passed in 0.02s", "Ran 3 tests in 0.004s") are the
# one part of a command's output that differs between identical states; they are masked so that the
# same state gives the same observation and the same seed the same trajectory.
_DURATIONS = re.compile(r"(\bin )\d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?(?= |$|\)|=)", re.M)


def normalise_durations(text: str) -> str:
    return _DURATIONS.sub(r"\1<t>s", text)


def command_observation(result: ExecResult, timeout: float) -> Observation:
    body = truncate(normalise_durations(result.output))
    if body and not body.endswith("\n"):
        body += "\n"
    if result.timed_out:
        return Observation(f"{body}[timed out after {timeout:g} s; the command was killed]")
    return Observation(f"{body}[exit code: {result.exit_code}]")


# ----------------------------------------------------------------------------- the five tools

def _repo_path(sandbox: Sandbox, path: str) -> str:
    """`path` relative to the repository root; an absolute path inside the root is accepted."""
    p = path.strip()
    if not p:
        raise ToolCallError("path is empty")
    root = sandbox.repo_dir.rstrip("/")
    if p.startswith("/"):
        if not p.startswith(root + "/"):
            raise ToolCallError(f"path {path!r} is outside the repository {root}; use a path relative to it")
        p = p[len(root) + 1:]
    p = posixpath.normpath(p)
    if p == ".." or p.startswith("../"):
        raise ToolCallError(f"path {path!r} is outside the repository")
    if p == ".":
        raise ToolCallError(f"path {path!r} is the repository root, not a file")
    return p


def _path_kind(sandbox: Sandbox, path: str) -> str:
    res = sandbox.exec(f"if [ -d {shlex.quote(path)} ]; then echo directory; "
                       f"elif [ -e {shlex.quote(path)} ]; then echo unreadable; else echo missing; fi",
                       timeout=30)
    return res.output.strip()


def _read_text(sandbox: Sandbox, path: str) -> str | None:
    """The file's text (undecodable bytes kept as surrogates so an edit writes them back unchanged),
    None if it does not exist; ToolCallError with a deterministic reason if it cannot be read."""
    try:
        data = sandbox.read_file(path)
    except SandboxError:
        raise
    except (CRRError, OSError):  # the engine's message names host paths: say it in our own words
        kind = _path_kind(sandbox, path)
        if kind == "missing":
            return None
        if kind == "directory":
            raise ToolCallError(f"{path} is a directory; list it with run_shell (ls {path})") from None
        raise ToolCallError(f"{path} cannot be read (a link leading outside the repository?)") from None
    if b"\0" in data:
        raise ToolCallError(f"{path} is a binary file ({len(data)} bytes); inspect it with run_shell")
    return data.decode("utf-8", errors="surrogateescape")


def split_lines(text: str) -> list[str]:
    """Lines with their "\\n" (the last one may lack it); only "\\n" separates lines."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _printable(text: str) -> str:
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")


def view_file(sandbox: Sandbox, path: str, start: int = 1, end: int | None = None) -> Observation:
    path = _repo_path(sandbox, path)
    text = _read_text(sandbox, path)
    if text is None:
        raise ToolCallError(f"{path} does not exist")
    lines = split_lines(_printable(text))
    n = len(lines)
    if n == 0:
        return Observation(f"{path} is empty (0 lines).")
    if start > n:
        raise ToolCallError(f"start={start} is past the end of {path} ({n} lines)")
    if end is not None and end < start:
        raise ToolCallError(f"end={end} is before start={start}")
    return Observation(render_view(path, lines, start, end))


def render_view(path: str, lines: list[str], start: int = 1, end: int | None = None) -> str:
    """What view_file shows of a file's lines (checked: 1 <= start <= len(lines), end >= start or None)."""
    n = len(lines)
    last = min(n, start + VIEW_WINDOW_LINES - 1, end if end is not None else n)
    shown = "".join(f"{i:>6}\t{lines[i - 1].rstrip(chr(10)).rstrip(chr(13))}\n"
                    for i in range(start, last + 1))
    more = f"[{n - last} more lines; view_file with start={last + 1} to continue]\n" if last < n else ""
    return truncate(f"{path}: lines {start}-{last} of {n}\n{shown}{more}")


def edit_file(sandbox: Sandbox, path: str, start: int, end: int, replacement: str) -> Observation:
    path = _repo_path(sandbox, path)
    if path == ".git" or path.startswith(".git/"):
        raise ToolCallError("files under .git cannot be edited")
    text = _read_text(sandbox, path)
    if text is None and (start, end) != (1, 0):
        raise ToolCallError(f"{path} does not exist; create it with start=1, end=0")
    old = split_lines(text or "")
    n = len(old)
    if start > n + 1:
        raise ToolCallError(f"start={start} is past the end of {path} ({n} lines; start={n + 1} appends)")
    if end < start - 1:
        raise ToolCallError(f"end={end} is before start={start} (end=start-1 inserts before line start)")
    if end > n:
        raise ToolCallError(f"end={end} is past the end of {path} ({n} lines)")
    if replacement and not replacement.endswith("\n"):
        replacement += "\n"
    new = old[:start - 1] + split_lines(replacement) + old[end:]
    if text is not None and new == old:
        return Observation(f"No change: the replacement equals lines {start}-{end} of {path}.")
    try:
        sandbox.write_file(path, "".join(new).encode("utf-8", errors="surrogateescape"))
    except SandboxError:
        raise
    except (CRRError, OSError):
        raise ToolCallError(f"{path} cannot be written (a link leading outside the repository?)") from None
    return Observation(render_diff(path, old, new, created=text is None))


def render_diff(path: str, old: list[str], new: list[str], created: bool = False) -> str:
    """What edit_file shows after an edit: the unified diff of the file's lines."""
    diff = difflib.unified_diff([_printable(s).rstrip("\n") for s in old],
                                [_printable(s).rstrip("\n") for s in new],
                                fromfile="/dev/null" if created else f"a/{path}", tofile=f"b/{path}",
                                lineterm="")
    return truncate("\n".join(diff) + "\n")


def run_shell(sandbox: Sandbox, command: str, timeout: int = DEFAULT_SHELL_TIMEOUT_S) -> Observation:
    if not command.strip():
        raise ToolCallError("command is empty")
    return command_observation(sandbox.exec(command, timeout=timeout), timeout)


def selector_args(test_filter: str) -> list[str]:
    """The selector as runner arguments: node ids and `-k EXPR` only, so it cannot inject shell or
    change the runner's options."""
    try:
        tokens = shlex.split(test_filter)
    except ValueError as e:
        raise ToolCallError(f"test_filter cannot be split into arguments: {e}") from None
    args: list[str] = []
    it = iter(tokens)
    for tok in it:
        if tok == "-k":
            expr = next(it, None)
            if expr is None:
                raise ToolCallError("test_filter: -k needs an expression")
            args += ["-k", expr]
        elif tok.startswith("-k"):
            args += ["-k", tok[2:]]
        elif tok.startswith("-"):
            raise ToolCallError(f"test_filter accepts test node ids and -k EXPR, not {tok!r}; "
                                "use run_shell for other options")
        else:
            args.append(tok)
    return args


def run_tests(sandbox: Sandbox, test_filter: str = "") -> Observation:
    args = selector_args(test_filter)
    command = " ".join([sandbox.task.run_tests_cmd or sandbox.task.test_cmd, *map(shlex.quote, args)])
    return command_observation(sandbox.exec(command, timeout=TEST_TIMEOUT_S), TEST_TIMEOUT_S)


def submit_patch(sandbox: Sandbox) -> Observation:
    return Observation("Patch submitted; the episode ends and the held-out tests will run.", terminal=True)


TOOLS: dict[str, Callable[..., Observation]] = {
    "view_file": view_file, "edit_file": edit_file, "run_shell": run_shell, "run_tests": run_tests,
    "submit_patch": submit_patch,
}
assert tuple(TOOLS) == TOOL_NAMES


def execute(sandbox: Sandbox, call_or_text: ToolCall | str) -> Observation:
    """Run one action. Invalid calls give an error observation; SandboxError propagates."""
    try:
        call = parse_tool_call(call_or_text) if isinstance(call_or_text, str) else call_or_text
        validate(call)
        return TOOLS[call.name](sandbox, **call.arguments)
    except ToolCallError as e:
        return Observation(f"Error: {e}", is_error=True)


def play_calls(sandbox: Sandbox, texts: list[str]) -> Iterator[tuple[str, ToolCall | None, Observation]]:
    """Execute tool-call texts in order, up to the one that ends the episode: (text, the parsed call or
    None where it is invalid, observation) for each."""
    for text in texts:
        try:
            call = parse_tool_call(text)
        except ToolCallError:
            call = None
        obs = execute(sandbox, text if call is None else call)
        yield text, call, obs
        if obs.terminal:
            return


# ----------------------------------------------------------------------------- tool-type score

# Passive read/search commands (score 0): each stage of a pipeline must be one of these and the
# command must not redirect, substitute or background anything. Anything else counts as a shell
# command (0.75): the allow-list errs towards "state-changing".
PASSIVE_COMMANDS = frozenset({"grep", "egrep", "fgrep", "rg", "cat", "head", "tail", "ls", "find", "wc"})
PASSIVE_GIT = frozenset({"log", "show", "diff", "status"})
_FIND_ACTIONS = frozenset({"-exec", "-execdir", "-ok", "-okdir", "-delete", "-fprint", "-fprint0",
                           "-fprintf", "-fls"})
_SEPARATORS = frozenset({"|", "&&", "||", ";"})
TOOL_TYPE_SCORES = {"view_file": 0.0, "run_tests": 0.25, "run_shell": 0.75, "edit_file": 1.0}


def _passive_stage(words: list[str]) -> bool:
    if not words:
        return False
    cmd, args = words[0], words[1:]
    if cmd in PASSIVE_COMMANDS:
        return cmd != "find" or not _FIND_ACTIONS.intersection(args)
    if cmd == "sed":  # only `sed -n ...` printing, never in place
        return "-n" in args and not any(a.startswith(("-i", "--in-place")) for a in args)
    if cmd == "git":
        return bool(args) and args[0] in PASSIVE_GIT and not any(a.startswith("--output") for a in args)
    return False


def is_passive_command(command: str) -> bool:
    """True for a read/search command or a pipeline of them (see PASSIVE_COMMANDS)."""
    if "`" in command or "$(" in command:
        return False
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return False
    stages: list[list[str]] = [[]]
    for tok in tokens:
        if tok in _SEPARATORS:
            stages.append([])
        elif tok and set(tok) <= set("();<>|&"):  # redirection, background, subshell
            return False
        else:
            stages[-1].append(tok)
    return all(_passive_stage(s) for s in stages)


def tool_type_score(call: ToolCall) -> float | None:
    """type(a_t) of the selector: 0 passive read/search, 0.25 focused tests, 0.75 shell commands,
    1.0 file edits; None for submit_patch (terminal actions are never selected)."""
    if call.name == "submit_patch":
        return None
    if call.name == "run_shell" and is_passive_command(str(call.arguments.get("command", ""))):
        return 0.0
    return TOOL_TYPE_SCORES[call.name]


# ----------------------------------------------------------------------------- the agent's patch

# Byte-code and pytest caches appear whenever code runs; a repository without a .gitignore would
# otherwise put them into every patch.
_ARTEFACT_EXCLUDES = ("**/__pycache__/**", "**/*.pyc", "**/.pytest_cache/**")


def model_patch(sandbox: Sandbox) -> str:
    """The agent's changes as a git diff against task.base_commit, new files included.

    Stages everything into a temporary copy of the index (GIT_INDEX_FILE), so the repository's own
    index is untouched, and writes the diff to a scratch file read back whole (exec output is
    bounded). The copy keeps the index's mtime (cp -p): git rechecks the content of entries as new as
    the index ("racily clean"), and a fresh mtime would hide an edit made in the second of the checkout
    that kept the file's size. Raises SandboxError if git fails."""
    out = f"{SCRATCH_DIR}/model.patch"
    excludes = " ".join(shlex.quote(f":(exclude,glob){g}") for g in _ARTEFACT_EXCLUDES)
    script = (
        f'set -e; mkdir -p {SCRATCH_DIR}; tmp=$(mktemp); trap \'rm -f "$tmp"\' EXIT; '
        f'idx=$(git rev-parse --git-path index); '
        f'if [ -f "$idx" ]; then cp -p "$idx" "$tmp"; else rm -f "$tmp"; fi; '
        f'export GIT_INDEX_FILE="$tmp"; git add -A -- . {excludes}; '
        f"git diff --cached --binary --no-color --no-ext-diff {shlex.quote(sandbox.task.base_commit)} "
        f"> {out}")
    res = sandbox.exec(script, timeout=300)
    if res.exit_code != 0:
        raise SandboxError(f"could not take the model patch in {sandbox.task.instance_id} "
                           f"(exit {res.exit_code}): {res.output[-400:]}")
    return sandbox.read_file(out).decode("utf-8", errors="replace")
