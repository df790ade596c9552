"""Injected replay noise rho: outputs of branch steps resampled from what the same call gave in the realised
trajectories, in a real sandbox whose state stays real; seeded draws; rho = 0 injects nothing."""

from __future__ import annotations

import json

from crr.agent.episode import Episode, EpisodeConfig
from crr.sandbox import get_engine
from crr.train.replay_noise import RerunOutputs

CAT = json.dumps({"name": "run_shell", "arguments": {"command": "cat state.txt"}})
WRITE = json.dumps({"name": "run_shell", "arguments": {"command": "echo new > state.txt && cat state.txt"}})


def realised(task, engine, contents: list[str]):
    """One realised trajectory per content: the file set to it, then the same `cat` call."""
    trajs = []
    for i, text in enumerate(contents):
        ep = Episode(task, engine, _tok(), EpisodeConfig(max_turns=3, snapshots=False), sibling=i)
        ep.start()
        ep.act(json.dumps({"name": "run_shell", "arguments": {"command": f"echo {text} > state.txt"}}))
        ep.act(CAT)
        ep.traj.end_reason = "max_turns"
        ep.sandbox.close()
        trajs.append(ep.traj)
    return trajs


def _tok():
    from crr.policy.model import default_model_dir, load_policy

    return load_policy(default_model_dir())[1]


def test_injected_outputs_come_from_the_recorded_reruns_and_the_state_stays_real(make_task):
    task = make_task({"state.txt": "base\n"})
    with get_engine("local") as engine:
        trajs = realised(task, engine, ["alpha", "beta"])
        recorded = {s.observation for t in trajs for s in t.steps if s.call["arguments"]["command"] == "cat state.txt"}
        assert len(recorded) == 2

        def branch(rho: float, key: tuple[int, ...]):
            ep = Episode(task, engine, _tok(), EpisodeConfig(max_turns=4, snapshots=False))
            ep.start()
            ep.observe = RerunOutputs(trajs, rho, seed=5).for_branch(task.instance_id, key)
            ep.act(CAT)
            ep.act(WRITE)   # never recorded: nothing to resample from, the real output stays
            ep.traj.end_reason = "max_turns"
            state = ep.sandbox.read_file("state.txt").decode()
            ep.sandbox.close()
            return ep.traj.steps, state

        steps, state = branch(1.0, (0, 1, 0))
        assert steps[0].resampled and steps[0].observation in recorded        # "base" was never recorded
        assert not steps[1].resampled and "new" in steps[1].observation and state == "new\n"
        again, _ = branch(1.0, (0, 1, 0))
        assert again[0].observation == steps[0].observation                    # seeded per (branch, step)
        draws = {branch(1.0, (row, 1, 0))[0][0].observation for row in range(8)}
        assert draws == recorded                                               # both reruns get drawn
        clean, _ = branch(0.0, (0, 1, 0))
        assert not any(s.resampled for s in clean) and "base" in clean[0].observation
        assert RerunOutputs(trajs, 0.0, seed=5).for_branch(task.instance_id, (0,)) is None
