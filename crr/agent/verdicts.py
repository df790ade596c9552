"""The verifier's results by final state, for one run: an episode whose calls leave the sandbox as an earlier
episode of the same task left it gets that episode's verdict instead of a second test run.

    verdicts = Verdicts()
    result = verdicts.verify(sandbox, task, steps)   # verify(), or the verdict of the same final state

The final state is a function of the task and the calls that can change it: tools are deterministic (the
assumption verified replay makes, crr.agent.episode.replay_at), reads change nothing (view_file, a passive
shell command: crr.agent.tools.is_passive_command), submit_patch changes nothing, and a call that did not
parse was never executed. So `state_key` is the task and the sequence of edit_file and run_tests calls
(run_tests runs the agent's code, which can write files: kept in the key, in order). An episode that ran any
other shell command has no key and is always verified: such a command can change anything, also outside the
repository, and need not be deterministic. The test run itself is deterministic on the tasks crr trains on
(the determinism filter, crr.filter); a result the tests did not reach (an infrastructure failure, reward
None) is never kept.

Why not key by the model patch: it leaves out files the repository's ignore rules hide and everything outside
the repository. Why not by the tree digest: it walks the tree in a process of its own (50-160 ms, the price of
a third of a nano test run) and still sees only the repository.

In one round of the episode driver several episodes end together and are verified in parallel: the first to
reach a key runs the tests, the others with that key wait for its verdict.

On the committed multi-main CRR runs' records, 39-45 % of the on-policy trajectories and 36-42 % of the branches
end in a state an earlier episode of their run had ended in (scripts/reuse_rates.py, docs/training.md).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import threading
from collections.abc import Sequence

from crr.agent.tools import is_passive_command
from crr.agent.verifier import VERIFY_TIMEOUT_S, VerifierResult, verify
from crr.sandbox.base import Sandbox
from crr.tasks.schema import Task

READS = frozenset({"view_file", "submit_patch"})


def state_key(task: Task, steps: Sequence, timeout: float = VERIFY_TIMEOUT_S) -> str | None:
    """The key of the state the calls of `steps` (crr.agent.episode.Step) leave task's sandbox in; None when
    an unkeyable shell command ran (module doc)."""
    changes = []
    for s in steps:
        if s.call is None or s.call["name"] in READS:
            continue
        if s.call["name"] == "run_shell":
            if not is_passive_command(str(s.call["arguments"].get("command", ""))):
                return None
            continue
        changes.append(s.call)
    ident = [task.instance_id, task.base_commit, timeout, changes]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


class Verdicts:
    """`verify` with a memo of the run's verdicts by `state_key` (module doc). Thread-safe: the episode
    driver scores the episodes that end in a round in parallel. `reused` counts the test runs it saved."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, VerifierResult] = {}
        self._running: dict[str, threading.Event] = {}
        self.reused = 0

    def verify(self, sandbox: Sandbox, task: Task, steps: Sequence,
               timeout: float = VERIFY_TIMEOUT_S) -> VerifierResult:
        key = state_key(task, steps, timeout)
        if key is None:
            return verify(sandbox, task, timeout=timeout)
        while True:
            with self._lock:
                if key in self._known:
                    self.reused += 1
                    return copy.deepcopy(self._known[key])
                running = self._running.get(key)
                if running is None:
                    self._running[key] = threading.Event()
                    break
            running.wait()   # its verdict, or nothing kept (an infrastructure failure): then try again
        result = None
        try:
            result = verify(sandbox, task, timeout=timeout)
            return result
        finally:
            with self._lock:
                if result is not None and result.reward is not None:
                    # the log is the verifier's bounded copy; a reused verdict does not need it (episodes keep
                    # the reward, patch, report and notes), so the memo does not hold a run's logs
                    self._known[key] = dataclasses.replace(result, log="")
                self._running.pop(key).set()
