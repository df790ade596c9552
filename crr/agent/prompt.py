"""The prompting scaffold (paper: Appendix "Prompt and Tool Catalogue").

The system prompt is the paper's, verbatim for the default turn cap H = 50; the user prompt holds
the issue title, its body and the working directory; TOOL_SCHEMAS describes the five tools in the
OpenAI / Hugging Face function-calling format, so it can go straight into
`tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS)` and into the JSON grammar of the
constrained decoder. crr.agent.tools validates every call against these same schemas.

Agent formats. The paper's prompt and tool catalogue render to about a thousand tokens before the
issue, which is most of a CPU-scale episode. `FORMATS` holds the ways an episode can be presented to
the model, chosen by name (`agent_format` in every config): "paper" (the default, verbatim) and
"compact" (CPU scale: a short system prompt that lists the same five tools as one-line signatures
instead of the chat template's JSON catalogue, the issue without the repository header, and
observations cut to a smaller budget), so a nano episode fits in about a thousand tokens. The
conversation code, token layout and grammar are the same for both: the grammar is always compiled from
TOOL_SCHEMAS, and the tools accept the same calls whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from crr.errors import CRRError

if TYPE_CHECKING:
    from crr.tasks.schema import Task

DEFAULT_MAX_TURNS = 50  # the paper's turn cap H

_SYSTEM_PROMPT_TEMPLATE = (
    "You are an autonomous software engineer working in a containerised development environment. "
    "Your goal is to resolve the GitHub issue described by the user by editing the relevant source "
    "files and validating your changes against the project's test suite. You have access to the "
    "following tools: view_file, edit_file, run_shell, run_tests, submit_patch. Each turn you must "
    "emit a single tool call as a JSON object. The episode terminates when you call submit_patch or "
    "after {max_turns} turns. Read carefully before editing, edit minimally, and verify with the test "
    "suite before submission."
)


def system_prompt(max_turns: int = DEFAULT_MAX_TURNS) -> str:
    return _SYSTEM_PROMPT_TEMPLATE.format(max_turns=max_turns)


SYSTEM_PROMPT = system_prompt()


def user_prompt(task: Task, workdir: str) -> str:
    """The issue (title = first non-empty line of the problem statement, body = the rest) and where
    the repository is."""
    lines = task.problem_statement.strip().splitlines()
    title = lines[0].strip() if lines else ""
    body = "\n".join(lines[1:]).strip() or "(no description)"
    return (f"Repository: {task.repo}\n"
            f"Working directory: {workdir} (the repository root; tool paths are relative to it)\n\n"
            f"Issue title: {title}\n\n"
            f"Issue body:\n{body}\n")


# Limits the tools enforce; they appear in the schemas so the model and the grammar see them too.
VIEW_WINDOW_LINES = 200
DEFAULT_SHELL_TIMEOUT_S = 60
MAX_SHELL_TIMEOUT_S = 600


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_PATH = {"type": "string", "description": "File path relative to the repository root."}

TOOL_SCHEMAS: list[dict] = [
    _tool("view_file",
          f"Show up to {VIEW_WINDOW_LINES} lines of a file with line numbers, from line `start` "
          "(default 1) to line `end` (inclusive; default: as many as the window allows).",
          {"path": _PATH,
           "start": {"type": "integer", "minimum": 1, "default": 1,
                     "description": "First line to show (1-based)."},
           "end": {"type": "integer", "minimum": 1,
                   "description": "Last line to show (inclusive)."}},
          ["path"]),
    _tool("edit_file",
          "Replace lines `start`..`end` (1-based, inclusive) of a file with `replacement` and return "
          "a unified diff. Insert before line `start` with end = start - 1 (append with start = "
          "number of lines + 1); delete with an empty replacement; create a new file with start = 1, "
          "end = 0.",
          {"path": _PATH,
           "start": {"type": "integer", "minimum": 1, "description": "First line to replace (1-based)."},
           "end": {"type": "integer", "minimum": 0,
                   "description": "Last line to replace (inclusive); start - 1 to insert."},
           "replacement": {"type": "string",
                           "description": "The new lines (a final newline is added if missing)."}},
          ["path", "start", "end", "replacement"]),
    _tool("run_shell",
          "Run a bash command in the repository root and return its output and exit code.",
          {"command": {"type": "string", "description": "The bash command."},
           "timeout": {"type": "integer", "minimum": 1, "maximum": MAX_SHELL_TIMEOUT_S,
                       "default": DEFAULT_SHELL_TIMEOUT_S, "description": "Seconds before it is killed."}},
          ["command"]),
    _tool("run_tests",
          "Run the project's test suite with its canonical runner, optionally filtered by a "
          "pytest-style selector: test node ids (e.g. tests/test_x.py::test_y) and/or -k EXPR.",
          {"test_filter": {"type": "string", "default": "",
                           "description": "Node ids and/or -k EXPR; empty runs the whole suite."}},
          []),
    _tool("submit_patch",
          "Submit the current state of the repository as the fix; this ends the episode.",
          {}, []),
]

TOOL_NAMES: tuple[str, ...] = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)


# ----------------------------------------------------------------------------- agent formats

@dataclass(frozen=True)
class AgentFormat:
    """How an episode is shown to the model: system prompt, tool catalogue, user prompt, observation budget."""
    name: str
    system_template: str                 # str.format'ed with max_turns
    tools: list[dict]                    # the catalogue the chat template renders ([]: none, the prompt lists them)
    repo_header: bool                    # the user prompt names the repository and working directory
    obs_keep_chars: int | None           # observations keep their first and last this many characters

    def system_prompt(self, max_turns: int) -> str:
        return self.system_template.format(max_turns=max_turns)

    def user_prompt(self, task: Task, workdir: str) -> str:
        if self.repo_header:
            return user_prompt(task, workdir)
        return task.problem_statement.strip() + "\n"


FORMATS: dict[str, AgentFormat] = {
    "paper": AgentFormat("paper", _SYSTEM_PROMPT_TEMPLATE, TOOL_SCHEMAS, repo_header=True, obs_keep_chars=None),
    "compact": AgentFormat(
        "compact",
        "Fix the issue in the repository. Tools: view_file(path, start, end), edit_file(path, start, end, "
        "replacement) replaces lines start..end, run_shell(command), run_tests(test_filter), submit_patch(). "
        "One tool call per turn, at most {max_turns} turns.",
        [], repo_header=False, obs_keep_chars=600),
}
DEFAULT_FORMAT = "paper"


def agent_format(name: str | None) -> AgentFormat:
    """The format called `name` (None: the paper's)."""
    name = DEFAULT_FORMAT if name is None else name
    if name not in FORMATS:
        raise CRRError(f"unknown agent format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]
