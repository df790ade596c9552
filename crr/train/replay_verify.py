"""Re-execute recorded counterfactual suffixes (paper: Appendix "Counterfactual Trajectory Dataset": the
tuples carry "action suffixes sufficient for replay").

Each sampled tuple is replayed in a fresh sandbox of its task: the realised prefix a_0..a_{t-1}, then the
counterfactual suffix, then the verifier; the tuple reproduces when the return equals R(tilde tau). The
snapshots of s_t are gone once an iteration ends, so every replay starts from s_0; that also checks that
the prefix itself is deterministic.
"""

from __future__ import annotations

from pathlib import Path

from crr.agent.tools import execute
from crr.agent.verifier import verify
from crr.errors import CRRError
from crr.sandbox import engine_spec_of
from crr.rundir import RunDir
from crr.tasks.loaders import load_tasks
from crr.train.tuples import read_tuples


def replay_tuples(run_path: Path | str, sample: int, seed: int = 0) -> dict:
    if sample < 1:
        raise CRRError(f"--sample must be at least 1, got {sample}")
    run = RunDir.open(run_path)
    df = read_tuples(run.path).dropna(subset=["cf_reward"])
    if df.empty:
        raise CRRError(f"{run.path} has no scored counterfactual tuples to replay (a grpo run, or none finished)")
    df = df.sample(n=min(sample, len(df)), random_state=seed)
    config = run.config
    tasks = {t.instance_id: t for t in load_tasks(config["tasks"])}
    results = []
    with engine_spec_of(config).make() as engine:
        for row in df.itertuples():
            if row.task_id not in tasks:
                raise CRRError(f"task {row.task_id} of the tuples is not in {config['tasks']}")
            with engine.start(tasks[row.task_id]) as sandbox:
                for action in list(row.prefix_actions) + list(row.counterfactual_suffix):
                    execute(sandbox, action)
                reward = verify(sandbox, tasks[row.task_id]).reward
            results.append({"task_id": row.task_id, "iteration": int(row.iteration), "t": int(row.t),
                            "recorded": float(row.cf_reward), "replayed": reward,
                            "reproduced": reward == row.cf_reward})
    return {"sampled": len(results), "reproduced": sum(r["reproduced"] for r in results),
            "fraction": sum(r["reproduced"] for r in results) / len(results), "tuples": results}
