"""`crr train` end to end on CPU: the real tiny model, real local sandboxes and forks, real TRL updates for
each method; a complete run directory; resume after an interrupted iteration (torn checkpoints included)
reproduces it exactly and records every update once; `crr replay verify` re-executes recorded suffixes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from crr.cli import app
from crr.policy.model import default_model_dir
from crr.rundir import RunDir, release_locks
from crr.tasks.loaders import load_tasks, write_tasks
from crr.train.trainer import checkpoint_gap, checkpoints, resume_run, update_rewards
from crr.train.tuples import read_tuples

SMALL = ["n_tasks=1", "tasks_per_iteration=1", "num_generations=3", "max_turns=2", "max_new_tokens=40", "k=2",
         "eta=0.0", "workers=2", "warmup_steps=0",
         # the random tiny model (paper format): its varied returns on the `ran` task give these runs nonzero
         # advantages; the shipped warm start never solves that task, so with it nothing would move
         f"model={default_model_dir()}", "agent_format=paper"]
# The shipped warm start's bf16 weights trained in float32, by the tests whose subject is not the dtype: a CPU
# without AVX512-BF16 emulates bf16, and the learner's update takes ~10x as long (crr doctor's bf16 row; a bf16
# update: test_other_methods_end_to_end[grpo])
FP32 = ["dtype=float32"]




def run_train(args: list[str], root: Path) -> tuple[str, Path]:
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    runs = sorted(root.glob("*-train-*"))
    assert len(runs) == 1
    return result.output, runs[0]


def assert_each_update_once(run: Path, updates: int) -> None:
    """metrics.jsonl, ledger.json and the reward curve hold each of the first `updates` updates exactly once."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for event, key, first in (("iteration", "step", 1), ("ledger", "iteration", 0)):
        assert [r[key] for r in records if r.get("event") == event] == list(range(first, first + updates)), event
    # TRL's records of each update (its end-of-training summary, train_loss, shares the last step)
    assert ([r["step"] for r in records if r.get("event") == "trl" and "train_loss" not in r]
            == list(range(1, updates + 1)))
    ledger = json.loads((run / "ledger.json").read_text())
    assert [it["iteration"] for it in ledger["iterations"]] == list(range(updates))
    assert len(update_rewards(RunDir.open(run))) == updates


def lora_b_norm(path: Path) -> float:
    weights = load_file(path / "adapter_model.safetensors")
    return sum(float(w.abs().sum()) for k, w in weights.items() if "lora_B" in k)


def test_crr_end_to_end_and_resume(ran_tasks_file, tmp_path):
    out, run = run_train(["--method", "crr", "--out", str(tmp_path), "--max-updates", "2", f"tasks={ran_tasks_file}",
                          *SMALL], tmp_path)
    assert "2/2 R" in out and "fork share" in out
    for name in ("config.yaml", "manifest.json", "metrics.jsonl", "ledger.json", "summary.json"):
        assert (run / name).is_file(), name
    assert lora_b_norm(run / "model") > 0           # LoRA B starts at 0: a real update moved it
    ledger = json.loads((run / "ledger.json").read_text())
    assert len(ledger["iterations"]) == 2 and ledger["cumulative"]["updates"] == 2
    assert ledger["cumulative"]["trajectories"] == 6 and ledger["cumulative"]["forks"] > 0
    assert ledger["cumulative"]["generated_tokens_all"] > ledger["cumulative"]["generated_tokens_on_policy"]
    assert ledger["cumulative"]["observed_tokens_all"] > ledger["cumulative"]["observed_tokens_on_policy"] > 0
    tuples = read_tuples(run)
    assert len(tuples) == ledger["cumulative"]["forks"]
    assert (tuples["realised_action"] != tuples["counterfactual_action"]).all()
    assert tuples["t"].max() < 2 and tuples["reward"].notna().all()
    iters = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("event") == "iteration"]
    assert [r["step"] for r in iters] == [1, 2] and sum(r["contrasts"] for r in iters) > 0

    assert not (run / "checkpoints" / ".staging").exists()
    assert [checkpoint_gap(c) for _, c in checkpoints(run / "checkpoints")] == [None, None]

    # An interruption while iteration 2 was saved (a checkpoint written in place, as transformers does): no
    # trainer state and no summary; its tuples part and metrics records already there. Settings a resume cannot
    # change are refused, in one line, before anything is written; --max-updates is applied and said.
    (run / "checkpoints" / "checkpoint-2" / "trainer_state.json").unlink()
    (run / "summary.json").unlink()
    before, metrics = read_tuples(run), (run / "metrics.jsonl").read_text()
    for args in (["k=7"], ["--seed", "5"], ["--method", "grpo"], ["--budget-hours", "1", "lora_r=16"]):
        result = CliRunner().invoke(app, ["train", "--resume", str(run), *args])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert "a resumed run keeps its settings but max_steps and budget_hours" in result.output
    assert (run / "metrics.jsonl").read_text() == metrics and (run / "checkpoints" / "checkpoint-2").is_dir()
    out2, _ = run_train(["--resume", str(run), "--max-updates", "3", "k=2"], tmp_path)
    assert "checkpoint-2 is incomplete (no trainer_state.json): removed, resuming from checkpoint-1" in out2
    assert "resuming with max_steps=3 (was 2)" in out2
    assert "2/3 R" in out2 and "3/3 R" in out2 and "1/3 R" not in out2   # only the lost iteration is redone
    assert yaml.safe_load((run / "config.yaml").read_text())["max_steps"] == 3
    after = read_tuples(run)
    cols = ["iteration", "t", "realised_action", "counterfactual_action", "reward", "cf_reward"]
    assert before[cols].equals(after[after.iteration < 2][cols])   # same seed, restored weights: the same iteration
    assert_each_update_once(run, 3)

    # The optimizer's state lost (a checkpoint saved in place, cut short, so no summary either): the resume falls
    # back to the previous checkpoint and cuts the records back to it (training on from there is what the resume
    # above did).
    (run / "checkpoints" / "checkpoint-3" / "optimizer.pt").unlink()
    (run / "summary.json").unlink()
    cfg, resumed, ckpt = resume_run(run)
    release_locks()
    assert Path(ckpt).name == "checkpoint-2" and not (run / "checkpoints" / "checkpoint-3").exists()
    assert_each_update_once(run, 2)
    assert set(read_tuples(run)["iteration"]) <= {0, 1}

    result = CliRunner().invoke(app, ["replay", "verify", str(run), "--sample", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["sampled"] == min(3, len(after.dropna(subset=["cf_reward"]))) and report["fraction"] == 1.0
    refused = CliRunner().invoke(app, ["replay", "verify", str(run), "--sample", "-1"])
    assert refused.exit_code == 2 and "--sample must be at least 1" in refused.output, refused.output


def test_a_run_stopped_after_its_last_checkpoint_is_finished_without_training(ran_tasks_file, tmp_path):
    """Stopped after checkpoint-1 of 1 but before its summary, in an epoch of two updates (two tasks, one an
    update): the resume writes the model and summary from that checkpoint (before: TRL's loop, which skips the
    epoch's done batches and checks for the stop after a step, trained and recorded a second update)."""
    (task,) = load_tasks(ran_tasks_file)
    tasks = write_tasks([task, dataclasses.replace(task, instance_id="ran-again")], tmp_path / "tasks.jsonl")
    _, run = run_train(["--method", "grpo", "--out", str(tmp_path / "runs"), "--max-updates", "1", f"tasks={tasks}",
                        *SMALL, "n_tasks=2"], tmp_path / "runs")
    (run / "summary.json").unlink()
    shutil.rmtree(run / "model")
    out, _ = run_train(["--resume", str(run)], tmp_path / "runs")
    assert [step for step, _ in checkpoints(run / "checkpoints")] == [1], out
    assert json.loads((run / "summary.json").read_text())["updates"] == 1
    assert_each_update_once(run, 1)
    final, saved = load_file(run / "model" / "adapter_model.safetensors"), \
        load_file(run / "checkpoints" / "checkpoint-1" / "adapter_model.safetensors")
    assert final.keys() == saved.keys() and all(np.array_equal(final[k].float(), saved[k].float()) for k in final)


@pytest.mark.parametrize("method", ["grpo", "search-select", "mc-values"])
def test_other_methods_end_to_end(method, ran_tasks_file, tmp_path):
    # max_turns=3: returns then differ between the G siblings of the first group (seed 11); grpo's run loads the
    # random tiny model (saved in float32) in bf16, the shipped default's dtype: the suite's one bf16 update
    extra = {"search-select": ["replay_noise=1.0"], "mc-values": ["cf_samples=1"]}.get(
        method, ["--eval", str(ran_tasks_file), "--eval-n", "1", "dtype=bfloat16"])
    out, run = run_train(["--method", method, "--out", str(tmp_path), "--max-updates", "1", f"tasks={ran_tasks_file}",
                          *SMALL, "max_turns=3", *extra], tmp_path)
    assert "1/1 R" in out
    if method == "grpo":  # held-out pass@1 before and after, each an eval run inside the train run
        assert json.loads((run / "summary.json").read_text())["dtype"] == "bfloat16"
        assert "held-out pass@1" in out and "training reward per update" in out
        for when in ("before", "after"):
            (eval_run,) = (run / f"eval-{when}").iterdir()
            assert json.loads((eval_run / "summary.json").read_text())["n_instances"] == 1
        # Stopped in the evaluation after training: the resume its hint names, without --eval, finishes that
        # evaluation (the one it started, not a second one), since the run's eval-before/ records its --eval.
        (eval_run / "summary.json").unlink()
        out2, _ = run_train(["--resume", str(run)], tmp_path)
        assert "held-out pass@1" in out2 and [p.name for p in (run / "eval-after").iterdir()] == [eval_run.name]
        assert len(list((run / "eval-before").iterdir())) == 1
        refused = CliRunner().invoke(app, ["train", "--resume", str(run), "--eval", "nano-test"])
        assert refused.exit_code == 2 and f"was started with --eval {ran_tasks_file} --eval-n 1" in refused.output
        refused = CliRunner().invoke(app, ["train", "--resume", str(eval_run)])
        assert refused.exit_code == 2 and "is a `crr eval` run, not a training run" in refused.output
        # a resume refused for a corrupt ledger has written nothing, not even the new --max-updates
        config, ledger = (run / "config.yaml").read_bytes(), (run / "ledger.json").read_bytes()
        (run / "ledger.json").write_text('{"broken')
        refused = CliRunner().invoke(app, ["train", "--resume", str(run), "--max-updates", "2"])
        assert refused.exit_code == 2 and "ledger.json is corrupt" in refused.output, refused.output
        assert (run / "config.yaml").read_bytes() == config
        (run / "ledger.json").write_bytes(ledger)
    assert lora_b_norm(run / "model") > 0
    ledger = json.loads((run / "ledger.json").read_text())["cumulative"]
    assert ledger["updates"] == 1 and ledger["trajectories"] == 3
    it = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
          if r.get("event") == "iteration"][0]
    if method == "grpo":
        assert ledger["forks"] == 0 and not (run / "tuples").exists() and it["selected"] == 0
    elif method == "mc-values":   # K = 1 on-policy continuation from every non-terminal state, charged like forks
        assert ledger["forks"] == len(read_tuples(run)) > 0 and it["selected"] == 0 and it["replaced"] is None
        assert ledger["cf_rollout_s"] > 0 and ledger["cf_test_s"] > 0
        assert ledger["generated_tokens_all"] > ledger["generated_tokens_on_policy"]
    else:
        assert ledger["forks"] > 0 and it["replaced"] is not None and 0 <= it["replaced"] <= 3
        assert it["replay_noise_steps"] > 0 and 0 <= it["replay_noise_injected"] <= it["replay_noise_steps"]


def test_bad_input_is_a_clear_error(tmp_path, monkeypatch):
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path), "nonsense=1"])
    assert result.exit_code == 2 and "unknown config key" in result.output
    result = CliRunner().invoke(app, ["train", "--method", "ppo", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown method" in result.output
    result = CliRunner().invoke(app, ["train", "--config", "experiments/cpu-resets.yaml", "--out", str(tmp_path),
                                      "cf_samples=1"])
    assert result.exit_code == 2 and "take 2 <= cf_samples < num_generations" in result.output
    # --eval's tasks and size are checked before the run directory is made
    for args, said in ((["--eval", "nosuchset"], "'nosuchset' is not a file"),
                       (["--eval", "nano-test2", "--eval-n", "0"], "--eval-n must be at least 1"),
                       (["--eval-n", "3"], "give --eval too")):
        result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "runs"), *args])
        assert result.exit_code == 2 and said in result.output, result.output
    # nan is no number of seconds or temperature (every comparison with it is false)
    result = CliRunner().invoke(app, ["eval", "nano-val", "--temperature", "nan", "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "--temperature must be a number >= 0, got nan" in result.output
    (tmp_path / "empty.jsonl").write_text("")
    result = CliRunner().invoke(app, ["eval", "tasks", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "empty.jsonl holds no tasks" in result.output
    # refused before its task set is loaded (a named set is generated on its first use, a minute on two cores)
    monkeypatch.setattr("crr.rollout.load_tasks",
                        lambda *_: pytest.fail("tasks loaded before the settings were checked"))
    result = CliRunner().invoke(app, ["rollout", "--tasks", "nano-val", "--time-limit", "nan",
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "time_limit_s must be positive, got nan" in result.output
    result = CliRunner().invoke(app, ["rollout", "--tasks", "nano-val", "--model", str(tmp_path / "nope"),
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "nope: no such directory" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_finished_run_without_its_weights_is_not_resumed(tmp_path):
    """A finished run copied without its checkpoints' weights (the committed reference runs): a resume would redo its
    updates and replace their records, so it is refused before anything is written."""
    ref = Path(__file__).resolve().parents[1] / "results" / "reference" / "cpu-main" / "runs" / "crr"
    run = tmp_path / "run"
    source = sorted(ref.glob("*-train-crr-seed11"))[0]
    for f in subprocess.run(["git", "ls-files", "."], cwd=source, capture_output=True, text=True,
                            check=True).stdout.split():   # what a clone holds: no weights
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / f, run / f)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["train", "--resume", str(run)])
    release_locks()
    assert result.exit_code == 2 and "finished, and its checkpoints after the start cannot be resumed" in result.output
    assert "nothing was changed (to redo them, remove its summary.json)" in result.output, result.output
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_overrides_parse_numbers_as_yaml_and_python_write_them():
    from crr.credit.audit import parse_overrides as audit_overrides
    from crr.experiments import EXPERIMENTS, Arm
    from crr.train.config import load_config, parse_overrides

    parsed = parse_overrides(["learning_rate=2e-3", "beta=1E-2", "k=2", "eta=0.5", "tasks=nano-band", "horizon=null"])
    assert parsed == {"learning_rate": 0.002, "beta": 0.01, "k": 2, "eta": 0.5, "tasks": "nano-band", "horizon": None}
    assert load_config(None, parse_overrides(["learning_rate=2e-3"])).learning_rate == 0.002
    # the audit's and a comparison arm's overrides are read the same way (crr.experiments.override)
    assert audit_overrides(["cf_temperature=7e-1", "continuations=8"]) == {"cf_temperature": 0.7, "continuations": 8}
    assert Arm("a", EXPERIMENTS / "cpu-crr.yaml", ["trl.beta=4e-2", "crr.k=2"]).settings["beta"] == 0.04


def test_an_estimator_outside_crr_trains_and_gets_the_state_keys(ran_tasks_file, tmp_path, monkeypatch):
    # A toy estimator in a module of its own, named by dotted path with a parameter, on the GiGPO method (state
    # keys recorded): it trains one update and sees the same record as any estimator.
    (tmp_path / "toy_credit.py").write_text(
        "SEEN = []\n\n\ndef toy(rows, bonus=0.0):\n    SEEN.extend(rows)\n"
        "    return [None if r.reward is None else [r.reward - 0.5 + bonus] * len(r.spans) for r in rows]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out, run = run_train(["--method", "gigpo", "--out", str(tmp_path / "toy"), "--max-updates", "1",
                          f"tasks={ran_tasks_file}", *SMALL, "advantage_estimator=toy_credit:toy",
                          "advantage_params={bonus: 0.25}"], tmp_path / "toy")
    import toy_credit

    rows = toy_credit.SEEN
    assert "1/1 R" in out and len(rows) == 3 and lora_b_norm(run / "model") > 0
    assert all(len(r.state_keys) == len(r.spans) > 0 for r in rows)
    assert len({r.state_keys[0] for r in rows}) == 1          # the G siblings all start in the same s_0
    it = next(r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("event") == "iteration")
    assert it["gigpo_groups"] >= 1 and 0 < it["gigpo_steps_grouped"] <= 1 and it["adv_mean"] == pytest.approx(
        np.mean([r.reward - 0.25 for r in rows for _ in r.spans]))


def test_verdicts_reused_by_final_state_change_no_reward(ran_tasks_file, tmp_path):
    # the same seed with and without the memo of verdicts (crr.agent.verdicts): the same trajectories and
    # rewards, and the memo spared test runs (ledger verdicts_reused; mc-values continues from every state)
    from crr.train.records import read_records

    seen = {}
    for reuse in ("true", "false"):
        _, run = run_train(["--method", "mc-values", "--out", str(tmp_path / reuse), "--max-updates", "1",
                            f"tasks={ran_tasks_file}", *SMALL, "cf_samples=2", f"reuse_verdicts={reuse}"],
                           tmp_path / reuse)
        records = read_records(run)
        seen[reuse] = ([(r["kind"], r.get("t"), r["reward"], r.get("model_patch"), [s.get("call") for s in r["steps"]])
                        for r in records], json.loads((run / "ledger.json").read_text())["cumulative"])
    assert seen["true"][0] == seen["false"][0] and len(seen["true"][0]) > 3
    assert seen["true"][1]["verdicts_reused"] > 0 and seen["false"][1]["verdicts_reused"] == 0


def test_branches_beside_the_update_change_nothing_but_the_clock(tmp_path):
    # branches_beside_update (crr.train.trainer._rollout): the branches run in a helper thread beside TRL's
    # reference pass and the loss's forward pass, joined when the loss reads the advantages. The CPU preset on the
    # shipped warm start, its weights in float32 (FP32: its subject is the threads, not the dtype): the same seed
    # gives the same trajectories, branches, advantages and losses as with the branches before the update, and the
    # ledger still partitions each iteration, the seconds the branches ran beside the update charged to cf_beside_s
    from crr.train.records import read_records

    seen = {}
    for beside in ("true", "false"):
        _, run = run_train(["--config", "experiments/cpu-crr.yaml", "--out", str(tmp_path / beside), "--max-updates",
                            "2", "workers=2", f"branches_beside_update={beside}", *FP32], tmp_path / beside)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        seen[beside] = ([(r["kind"], r.get("t"), r["reward"], [(s.get("call"), s.get("advantage")) for s in r["steps"]])
                         for r in read_records(run)],
                        [(r.get("loss"), r.get("kl")) for r in metrics if r.get("event") == "trl"],
                        json.loads((run / "ledger.json").read_text())["iterations"])
    assert seen["true"][:2] == seen["false"][:2]
    # forks in both updates; the adapter moved before the second
    assert [it["forks"] > 0 for it in seen["true"][2]] == [True, True] and seen["true"][1][1][1] > 0
    for beside, (_, _, iterations) in seen.items():
        for it in iterations:
            assert sum(it[k] for k in ("rollout_s", "fork_s", "cf_rollout_s", "cf_test_s", "update_s")) <= it["wall_s"]
            assert min(it["fork_s"], it["cf_rollout_s"], it["cf_test_s"], it["update_s"]) >= 0
        assert (sum(it["cf_beside_s"] for it in iterations) > 0) == (beside == "true")


def test_a_failure_beside_the_update_is_the_runs_error_and_leaves_no_sandbox(ran_tasks_file, tmp_path, monkeypatch):
    # the branches' thread fails after its forks have run: train raises that error once TRL's reference pass is
    # done (neither hangs nor swallows it), and the engine's directory is gone
    from crr.train import trainer
    from crr.errors import CRRError

    real, engines = trainer.run_branches, []

    def failing(*args, **kwargs):
        engines.append(kwargs["engine"])
        real(*args, **kwargs)
        raise CRRError("a branch failed")

    monkeypatch.setattr(trainer, "run_branches", failing)
    result = CliRunner().invoke(app, ["train", "--method", "crr", "--out", str(tmp_path), "--max-updates", "1",
                                      f"tasks={ran_tasks_file}", *SMALL])
    assert result.exit_code == 2 and "a branch failed" in result.output, result.output
    assert len(engines) == 1 and not engines[0].dir.exists()


def test_resets_train_restart_rows_on_their_own_steps(tmp_path, monkeypatch):
    # The preset (SRPO's reset at the first erroneous step, located by rule: a failure's first edit) on the
    # shipped warm start in float32 (FP32), whose nano failures edit: G = 4 rows per task, 2 on-policy trajectories
    # and M = 2 restart rows, on-policy continuations from the state of a failed one; TRL gets a restart row's
    # prefix (the failed sibling's steps) masked out of the loss
    from crr.train.records import read_records
    from crr.train.trainer import CRRTrainer

    seen = []
    rows = CRRTrainer._rows

    def spy(self, batch, *args, **kwargs):
        out = rows(self, batch, *args, **kwargs)
        seen.append((batch, out))
        return out

    monkeypatch.setattr(CRRTrainer, "_rows", spy)
    out, run = run_train(["--config", "experiments/cpu-resets.yaml", "--out", str(tmp_path), "--max-updates", "2",
                          "max_turns=4", "workers=2", *FP32], tmp_path)
    assert "2/2 R" in out and lora_b_norm(run / "model") > 0
    ledger = json.loads((run / "ledger.json").read_text())["cumulative"]
    assert ledger["trajectories"] == 8 and ledger["forks"] == 8       # per task: 2 on-policy + 2 restarts
    assert ledger["cf_rollout_s"] > 0 and ledger["generated_tokens_all"] > ledger["generated_tokens_on_policy"]
    records = read_records(run)
    assert [(r["update"], r["row"], r["sibling"]) for r in records] == [(u, i, i % 4) for u in (0, 1) for i in range(8)]
    assert len(seen) == 2 and any(t > 0 for batch, _ in seen for _, _, t in batch), "no task reset past s_0"
    for (batch, rows_out), update in zip(seen, (records[:8], records[8:])):
        assert [i for i, _, _ in batch] == [0, 1, None, None, 2, 3, None, None]
        check_restart_rows(batch, rows_out, update)


def check_restart_rows(batch, rows_out, records):
    """A restart row (reset t > 0) stands in the state of a failed sibling's first edit, its prefix copied and masked
    from the loss; every other row trains on every action token."""
    for r, t in [(r, t) for r, (_, _, t) in enumerate(batch) if t > 0]:
        restart = batch[r][1]
        parent = next(traj for _, traj, _ in batch[r - r % 4:r - r % 4 + 2] if traj.steps[:t] == restart.steps[:t])
        assert parent.reward == 0.0 and parent.steps[t].call["name"] == "edit_file" and restart.reward is not None
        start = restart.steps[t].span[0]
        assert start > 0 and rows_out["env_mask"][r] == [0] * start + restart.env_mask[start:]
        assert rows_out["crr_credit"][r]["reset"] == t == records[r]["reset"]
        assert all(s["advantage"] == 0.0 for s in records[r]["steps"][:t])
    for r, (_, traj, t) in enumerate(batch):
        if t == 0:
            assert rows_out["env_mask"][r] == traj.env_mask
