"""The environment demo (the main job until the trainer lands): one scripted episode with forks.

The scripted expert (crr.agent.expert) solves a micro task through the five tools. At two decision
points the sandbox is forked (snapshot sigma(s_t), restore rho), an alternative action a~_t is played
instead of a_t, the rest of the script runs forward in the fork, and the verifier scores both
branches: A_t = R(tau) - R(tau~_t), the CRR contrast of Eq. (1), on a real sandbox.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

from crr.agent.expert import expert_script, gold_files
from crr.agent.tools import ToolCall, execute, tool_type_score
from crr.agent.verifier import verify
from crr.errors import CRRError
from crr.sandbox.base import ForkEngine, Sandbox
from crr.rundir import RunDir
from crr.tasks.schema import Task

log = logging.getLogger(__name__)


@dataclass
class Step:
    t: int
    call: dict
    tool_type: float | None
    observation: str
    is_error: bool
    seconds: float


@dataclass
class Fork:
    t: int
    realised: dict
    counterfactual: dict
    r_realised: float | None
    r_counterfactual: float | None
    snapshot_ms: float
    restore_ms: float
    steps: list[Step] = field(default_factory=list)

    @property
    def advantage(self) -> float | None:
        if self.r_realised is None or self.r_counterfactual is None:
            return None  # an infrastructure failure is never a contrast
        return self.r_realised - self.r_counterfactual


@dataclass
class DemoResult:
    task: Task
    steps: list[Step]
    reward: float | None
    forks: list[Fork]


def play(sandbox: Sandbox, calls: list[ToolCall], t0: int = 0) -> list[Step]:
    """Execute calls in order until one ends the episode."""
    steps = []
    for t, call in enumerate(calls, start=t0):
        start = time.perf_counter()
        obs = execute(sandbox, call)
        steps.append(Step(t, {"name": call.name, "arguments": call.arguments}, tool_type_score(call),
                          obs.text, obs.is_error, time.perf_counter() - start))
        if obs.terminal:
            break
    return steps


def _decoy_file(sandbox: Sandbox, task: Task) -> str:
    """A Python file the gold patch does not touch (first in sorted order: deterministic)."""
    listing = sandbox.exec("git ls-files '*.py'", timeout=30).output.split()
    gold = set(gold_files(task))
    candidates = sorted(p for p in listing if p not in gold and "test" not in p)
    return candidates[0] if candidates else sorted(listing)[0]


def run_demo(task: Task, engine: ForkEngine, run: RunDir | None = None) -> DemoResult:
    script = expert_script(task)
    fork_points = {  # decision point -> the alternative action played there instead
        next(t for t, c in enumerate(script) if c.name == "view_file"): "view a decoy file",
        next(t for t, c in enumerate(script) if c.name == "edit_file"): "re-run the tests instead of editing",
    }
    snapshots, snap_ms = {}, {}
    with engine.start(task) as sandbox:
        decoy = _decoy_file(sandbox, task)
        steps: list[Step] = []
        for t, call in enumerate(script):
            if t in fork_points:
                start = time.perf_counter()
                snapshots[t] = sandbox.snapshot()
                snap_ms[t] = 1e3 * (time.perf_counter() - start)
            steps += play(sandbox, [call], t0=t)
            if steps[-1].call["name"] == "submit_patch":
                break
        realised = verify(sandbox, task)
    if realised.infra_error:
        raise CRRError(f"the verifier failed for infrastructure reasons: {realised.infra_error}")

    alternatives = {t: ToolCall("view_file", {"path": decoy, "start": 1, "end": 200})
                    if script[t].name == "view_file" else ToolCall("run_tests", {"test_filter": ""})
                    for t in fork_points}
    forks = []
    for t, alt in alternatives.items():
        start = time.perf_counter()
        with engine.restore(snapshots[t]) as fork_box:
            restore_ms = 1e3 * (time.perf_counter() - start)
            fork_steps = play(fork_box, [alt, *script[t + 1:]], t0=t)
            r_cf = verify(fork_box, task).reward
        engine.release(snapshots[t])
        forks.append(Fork(t, {"name": script[t].name, "arguments": script[t].arguments},
                          {"name": alt.name, "arguments": alt.arguments}, realised.reward, r_cf,
                          snap_ms[t], restore_ms, fork_steps))
    result = DemoResult(task, steps, realised.reward, forks)
    if run is not None:
        for s in steps:
            run.append("trajectory.jsonl", asdict(s))
        for f in forks:
            run.append("forks.jsonl", {**asdict(f), "advantage": f.advantage})
        run.write_json("summary.json", {"instance_id": task.instance_id, "reward": realised.reward,
                                        "per_test_status": realised.statuses,
                                        "contrasts": {f.t: f.advantage for f in forks}})
    return result
