"""The task row: SWE-bench compatible, plus `repo_src` for repositories that are not on GitHub.

Rows from SWE-bench Verified carry FAIL_TO_PASS/PASS_TO_PASS as JSON strings; SWE-Gym, SWE-rebench
and SWE-bench-Live carry lists. Both are accepted and normalised to tuples here.

Three optional fields tie a task to the sandbox layer (paper: Appendix "Determinism Filter and
Network Replay"); each is validated here:
  mirror       {"requirements": ["name==version --hash=sha256:HEX", ...]}: the hash-pinned lock of the
               task's environment (crr.sandbox.mirror); sandboxes install it from a local wheelhouse.
  sdist        {"name", "version", "filename", "sha256", "url"}: the PyPI source distribution the
               repository is rebuilt from when the row has no repo_src (crr.tasks.sdist).
  http_replay  {"cassette": PATH, "sha256": HEX}: the HTTP traffic recorded by the filter's gold run,
               replayed in every later sandbox (crr.sandbox.http); PATH is relative like repo_src.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from crr.errors import TaskFormatError
from crr.rundir import atomic_write_text

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
            "FAIL_TO_PASS", "PASS_TO_PASS", "version")
# Fields the public SWE-bench-family datasets carry that crr reads no further than keeping them.
KNOWN_EXTRA = ("hints_text", "created_at", "environment_setup_commit", "difficulty", "FAIL_TO_FAIL",
               "PASS_TO_FAIL", "install_config", "meta", "requirements", "environment", "license_name",
               "docker_image", "image_name", "test_cmds", "eval_type", "pull_number", "issue_numbers")
DEFAULT_TEST_CMD = "python -m pytest -rA -p no:cacheprovider"
DEFAULT_LOG_PARSER = "parse_log_pytest"
TASKS_FILE = "tasks.jsonl"  # a task set on disk: one row per line (`read_tasks_jsonl`, `write_tasks`)


@dataclass(frozen=True)
class Task:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    version: str
    image: str | None = None        # Docker image with the repository at /testbed
    eval_script: str | None = None  # swebench 5.x eval script; None: run `test_cmd` on the test ids
    log_parser: str = DEFAULT_LOG_PARSER  # a name in swebench's PARSER_REGISTRY
    repo_src: str | None = None     # absolute path to a git repository or bundle holding base_commit
    test_cmd: str = DEFAULT_TEST_CMD  # the canonical test runner: the verifier runs it on the held-out ids
    run_tests_cmd: str | None = None  # what the agent's `run_tests` runs (a filter appended); None: test_cmd
    mirror: dict | None = field(default=None, compare=False)       # see the module doc
    sdist: dict | None = field(default=None, compare=False)
    http_replay: dict | None = field(default=None, compare=False)
    metadata: dict = field(default_factory=dict, compare=False)  # e.g. difficulty, bug family, flaky
    extra: dict = field(default_factory=dict, compare=False)     # KNOWN_EXTRA fields, kept verbatim

    @classmethod
    def from_row(cls, row: dict, base_dir: Path | None = None) -> Task:
        """Validate one row; raises TaskFormatError naming the field and what was expected.

        `base_dir` resolves a relative `repo_src` (the directory of the JSONL file it came from).
        """
        if not isinstance(row, dict):
            raise TaskFormatError(f"expected a JSON object per row, got {type(row).__name__}")
        own = {f.name for f in fields(cls)}
        unknown = sorted(set(row) - own - set(KNOWN_EXTRA))
        if unknown:
            raise TaskFormatError(
                f"unknown field(s) {unknown}; a task row has {sorted(own - {'extra'})} "
                f"(and the dataset fields {list(KNOWN_EXTRA)}); put custom data under 'metadata'")
        for name in REQUIRED:
            if name not in row:
                raise TaskFormatError(f"missing required field '{name}'")
        values: dict[str, Any] = {}
        for name in REQUIRED:
            if name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
                values[name] = _test_list(name, row[name])
            else:
                values[name] = _string(name, row[name])
        if not values["instance_id"]:
            raise TaskFormatError("field 'instance_id': expected a non-empty string")
        for name in ("image", "eval_script", "repo_src"):
            if row.get(name) is not None:
                values[name] = _string(name, row[name])
        for name in ("log_parser", "test_cmd", "run_tests_cmd"):
            if row.get(name) is not None:
                values[name] = _string(name, row[name])
        for name, check in (("mirror", _mirror), ("sdist", _sdist), ("http_replay", _http_replay)):
            if row.get(name) is not None:
                values[name] = check(row[name])
        if "metadata" in row:
            if not isinstance(row["metadata"], dict):
                raise TaskFormatError("field 'metadata': expected a JSON object")
            values["metadata"] = row["metadata"]
        values["extra"] = {k: row[k] for k in KNOWN_EXTRA if k in row}
        if values.get("repo_src") and base_dir is not None and not Path(values["repo_src"]).is_absolute():
            values["repo_src"] = str((base_dir / values["repo_src"]).resolve())
        if values.get("http_replay") and base_dir is not None:
            cassette = Path(values["http_replay"]["cassette"])
            if not cassette.is_absolute():
                values["http_replay"] = {**values["http_replay"], "cassette": str((base_dir / cassette).resolve())}
        _check_parser(values.get("log_parser", DEFAULT_LOG_PARSER))
        return cls(**values)

    def to_row(self, relative_to: Path | None = None) -> dict:
        """A JSON-ready row; `repo_src` is written relative to `relative_to` when given."""
        row = asdict(self)
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = list(self.FAIL_TO_PASS), list(self.PASS_TO_PASS)
        extra = row.pop("extra")
        row.update(extra)
        if relative_to is not None:
            if self.repo_src:
                row["repo_src"] = _relative(self.repo_src, relative_to)
            if self.http_replay:
                row["http_replay"] = {**self.http_replay,
                                      "cassette": _relative(self.http_replay["cassette"], relative_to)}
        return {k: v for k, v in row.items() if v is not None and v != {}}

    @property
    def held_out_tests(self) -> tuple[str, ...]:
        return self.FAIL_TO_PASS + self.PASS_TO_PASS


def _relative(path: str, to: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(to.resolve()))
    except ValueError:
        return path


_SHA256 = re.compile(r"[0-9a-f]{64}")
# pip's hash-checking mode, one pinned wheel per line (what crr.sandbox.mirror.lock writes)
LOCK_LINE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*==[^\s;]+ --hash=sha256:[0-9a-f]{64}")


def _object(name: str, value: Any, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise TaskFormatError(f"field '{name}': expected a JSON object with {list(keys)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise TaskFormatError(f"field '{name}': missing {missing}")
    for k in keys:
        _string(f"{name}.{k}", value[k])
    return value


def _digest(name: str, value: str) -> None:
    if not _SHA256.fullmatch(value):
        raise TaskFormatError(f"field '{name}': expected 64 lowercase hex digits (a sha256), got {value[:70]!r}")


def _mirror(value: Any) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("requirements"), list) or not value["requirements"]:
        raise TaskFormatError("field 'mirror': expected {\"requirements\": [\"name==version --hash=sha256:HEX\", "
                              "...]} (a non-empty lock, as `crr tasks synth` writes it)")
    for line in value["requirements"]:
        if not isinstance(line, str) or not LOCK_LINE.fullmatch(line):
            raise TaskFormatError(f"field 'mirror.requirements': {line!r} is not a pinned, hashed requirement "
                                  "like 'pytest==8.3.5 --hash=sha256:<64 hex digits>'")
    return value


def _sdist(value: Any) -> dict:
    _object("sdist", value, ("name", "version", "filename", "sha256"))
    _digest("sdist.sha256", value["sha256"])
    if value.get("url") is not None:
        _string("sdist.url", value["url"])
    return value


def _http_replay(value: Any) -> dict:
    _object("http_replay", value, ("cassette", "sha256"))
    _digest("http_replay.sha256", value["sha256"])
    return value


def _string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TaskFormatError(f"field '{name}': expected a string, got {type(value).__name__}")
    return value


def _test_list(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # SWE-bench Verified stores these lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskFormatError(f"field '{name}': expected a list of test ids or a JSON string "
                                  f"encoding one, got unparsable text {value[:60]!r}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise TaskFormatError(f"field '{name}': expected a list of test-id strings")
    return tuple(value)


def _check_parser(name: str) -> None:
    from swebench.harness.log_parsers import PARSER_REGISTRY  # deferred: swebench takes ~1 s to import

    if name not in PARSER_REGISTRY:
        raise TaskFormatError(f"field 'log_parser': {name!r} is not a swebench log parser; "
                              f"use one of e.g. parse_log_pytest, parse_log_pytest_v2, parse_log_django")


# ------------------------------------------------------------------------------------ task files

def read_tasks_jsonl(path: Path | str) -> list[Task]:
    """Validate every line of a JSONL task file; the first bad line raises TaskFormatError."""
    path = Path(path)
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TaskFormatError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); "
                                      "each line must be one JSON object") from None
            task = _validated(row, where, base_dir=path.parent)
            if task.instance_id in seen:
                raise TaskFormatError(f"{where}: duplicate instance_id {task.instance_id!r} "
                                      f"(first on line {seen[task.instance_id]})")
            seen[task.instance_id] = lineno
            tasks.append(task)
    return tasks


def write_tasks(tasks: Iterable[Task], path: Path | str) -> Path:
    """Write tasks as JSONL atomically; repo_src is stored relative to the file's directory."""
    path = Path(path)
    lines = [json.dumps(t.to_row(relative_to=path.parent), sort_keys=True, ensure_ascii=False, default=str)
             for t in tasks]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


def _validated(row: Any, where: str, base_dir: Path | None = None) -> Task:
    try:
        return Task.from_row(row, base_dir=base_dir)
    except TaskFormatError as e:
        raise TaskFormatError(f"{where}: {e}") from None
