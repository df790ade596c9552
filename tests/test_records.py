"""One short real `crr train` (the tiny model, local sandboxes and forks, one TRL update, report_to=tensorboard):
every trajectory and branch is kept under trajectories/ with the advantages the update used; crr's
per-update metrics reach TensorBoard's event files beside TRL's; a resume redoes the update without
duplicating its records."""

from __future__ import annotations

import json
import shutil

import pytest
from test_trainer import SMALL, run_train

from crr.train.advantages import RowCredit
from crr.train.records import RECORDS_DIR, part_path, read_records, write_update
from crr.train.tuples import read_tuples



def test_records_tensorboard_and_resume(ran_tasks_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run = run_train(["--method", "crr", "--out", str(tmp_path), "--max-updates", "1", f"tasks={ran_tasks_file}",
                        *SMALL, "report_to=tensorboard"], tmp_path)
    recs = read_records(run)
    trajs = [r for r in recs if r["kind"] == "trajectory"]
    branches = [r for r in recs if r["kind"] == "branch"]
    assert [r["row"] for r in trajs] == [0, 1, 2] and {r["update"] for r in recs} == {0}
    assert all(r["task_id"] == "ran-1" and r["steps"] for r in trajs) and [r["sibling"] for r in trajs] == [0, 1, 2]
    forks = json.loads((run / "ledger.json").read_text())["cumulative"]["forks"]
    assert sum(b["proposal"] is not None for b in branches) == forks == len(read_tuples(run)) > 0
    it = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("event") == "iteration")
    # the advantages are the update's: GRPO's R - mean R of the siblings everywhere, except CRR's contrast
    # R(tau) - mean_K R(tilde tau_t) at a selected step with a scored branch
    mean = sum(r["reward"] for r in trajs) / len(trajs)
    differing = 0
    for r in trajs:
        for s in r["steps"]:
            assert s["grpo_advantage"] == pytest.approx(r["reward"] - mean)
            assert isinstance(s["entropy"], float) and ("call" in s or "action" in s)
            cf = [b["reward"] for b in branches
                  if b["row"] == r["row"] and b["t"] == s["t"] and b["reward"] is not None]
            if s["selected"] and cf:
                assert s["advantage"] == pytest.approx(r["reward"] - sum(cf) / len(cf))
                differing += s["advantage"] != s["grpo_advantage"]
            else:
                assert s["advantage"] == s["grpo_advantage"]
    assert it["contrasts"] > 0 and sum(it["outcome_pairs"].values()) == sum(b["reward"] is not None for b in branches)
    for b in branches:
        if b["proposal"] is not None and b["reward"] is not None:
            assert b["t"] < len(trajs[b["row"]]["steps"]) and b["steps"][0]["t"] == b["t"]

    # crr's per-update metrics in TensorBoard, beside TRL's (its TensorBoardCallback prefixes "train/")
    (events,) = {p.parent for p in (run / "checkpoints").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/reward", "train/crr/reward_mean", "train/crr/contrasts", "train/crr/cf_share",
            "train/crr/ledger/wall_s", "train/crr/outcome_pairs/1-0"} <= tags
    for tag, value in (("reward_mean", it["reward_mean"]), ("contrasts", it["contrasts"]),
                       ("ledger/fork_s", it["ledger"]["fork_s"])):
        (event,) = acc.Scalars(f"train/crr/{tag}")
        assert event.step == 1 and event.value == pytest.approx(value, rel=1e-6)
    assert not any(k.startswith("crr/") for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                   if r.get("event") == "trl" for k in r)   # metrics.jsonl keeps them in the iteration record only

    # an interruption before the update's checkpoint (and a torn temporary part): the resume redoes the
    # update and writes its part once, the same records again (same seed, same weights)
    shutil.rmtree(run / "checkpoints" / "checkpoint-1")
    part_path(run, 0).with_name("part-000000.jsonl.gz.tmp").write_bytes(b"\x1f\x8b torn")
    run_train(["--resume", str(run)], tmp_path)
    assert sorted(p.name for p in (run / RECORDS_DIR).iterdir()) == ["part-000000.jsonl.gz"]
    assert read_records(run) == recs
    resume = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("event") == "resume"]
    assert resume[-1]["dropped_record_parts"] == 2


def test_a_branch_a_sibling_played_names_its_row_across_processes(tmp_path):
    # two processes' parts: the second's branch was played by its own row 0, which is the batch's row 2
    def part(played_by):
        traj = {"kind": "trajectory", "task_id": "t", "sibling": 0, "reward": 1.0, "steps": [{"t": 0}]}
        return {"rows": 2, "records": [{**traj, "local": 0}, {**traj, "local": 1},
                                       {"kind": "branch", "local": 1, "t": 0, "played_by": played_by, "steps": []}]}

    rows = [RowCredit(g, 1.0, [(0, 1)]) for g in (0, 0, 1, 1)]
    write_update(tmp_path, 0, [part(None), part(0)], rows, [[0.0]] * 4)
    branches = [r for r in read_records(tmp_path) if r["kind"] == "branch"]
    assert [(b["row"], b["played_by"]) for b in branches] == [(1, None), (3, 2)]
