"""A scripted expert: the gold patch played through the five tools.

It is the policy of `crr demo` (the environment demo) and the seed of the SFT expert: look at the
tests, read the files the gold patch touches, make the gold edits, re-run the tests, submit.
"""

from __future__ import annotations

from unidiff import PatchSet

from crr.agent.tools import ToolCall
from crr.tasks.schema import Task


def gold_edits(task: Task) -> list[ToolCall]:
    """The gold patch as edit_file calls; hunks bottom-up so earlier line numbers stay valid."""
    calls = []
    for patched in PatchSet(task.patch):
        if patched.is_removed_file:
            calls.append(ToolCall("run_shell", {"command": f"rm -- {patched.path}", "timeout": 60}))
            continue
        for hunk in reversed(list(patched)):
            new_text = "".join(line.value for line in hunk if not line.is_removed)
            if patched.is_added_file or hunk.source_length == 0:
                # an insertion after line source_start (0 for a new file): an empty range start..start-1
                start, end = hunk.source_start + 1, hunk.source_start
            else:
                start, end = hunk.source_start, hunk.source_start + hunk.source_length - 1
            calls.append(ToolCall("edit_file", {"path": patched.path, "start": start, "end": end,
                                                "replacement": new_text}))
    return calls


def gold_files(task: Task) -> list[str]:
    return [p.path for p in PatchSet(task.patch) if not p.is_added_file]


def expert_script(task: Task) -> list[ToolCall]:
    """run_tests, view each gold file, the gold edits, run_tests, submit_patch."""
    views = [ToolCall("view_file", {"path": path, "start": 1, "end": 200}) for path in gold_files(task)]
    return [ToolCall("run_tests", {"test_filter": ""}), *views, *gold_edits(task),
            ToolCall("run_tests", {"test_filter": ""}), ToolCall("submit_patch", {})]
