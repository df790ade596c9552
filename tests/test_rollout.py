"""The rollout engine: G concurrent trajectories of the real tiny model in real local sandboxes, written to
the run directory as they finish; determinism per seed; the `crr rollout` command end to end."""

from __future__ import annotations

import dataclasses
import json

import pytest
from agent_tasks import CALC, TESTS, calc_task
from typer.testing import CliRunner

from crr.agent.episode import EpisodeConfig
from crr.cli import app
from crr.errors import CRRError
from crr.policy.backend import TransformersBackend
from crr.policy.model import default_model_dir, load_policy
from crr.sandbox import get_engine
from crr.rollout import TRAJECTORIES_FILE, RolloutConfig, ThreadWorkerPool, rollout, sample_seed
from crr.rundir import RunDir
from crr.tasks.loaders import write_tasks
from crr.train.counterfactual import LiveForks, run_branches
from crr.train.ledger import Ledger
from crr.train.selectors import Selection, SelectorParams, select



@pytest.fixture(scope="module")
def backend():
    return TransformersBackend(*load_policy(default_model_dir()), max_value_chars=4)


# pytest prints its wall time ("1 passed in 0.02s") and the tools pass it through: a task whose
# observations carry timings cannot give identical trajectories twice. This task's conftest pins it.
PINNED_PYTEST_DURATION = "import _pytest.terminal\n\n_pytest.terminal.format_session_duration = lambda s: \"(time)\"\n"


@pytest.fixture
def task(make_task):
    # calc_task's fields over calc_task's files plus the conftest
    fields = dataclasses.asdict(calc_task(make_task))
    files = {"calc.py": CALC, "tests/test_calc.py": TESTS, "README.md": "calc\n", "conftest.py": PINNED_PYTEST_DURATION}
    return make_task(files, **{k: v for k, v in fields.items() if k not in ("base_commit", "repo_src")})


CONFIG = EpisodeConfig(max_turns=3, max_new_tokens=40, temperature=1.0)


def run_group(backend, task, seed: int, run: RunDir | None = None, group_size: int = 3):
    with get_engine("local") as engine:
        result = rollout([task], backend, engine, backend.tokenizer,
                         RolloutConfig(group_size=group_size, seed=seed, workers=2, episode=CONFIG), run=run)
        assert all(t.snapshots for t in result.trajectories if t.steps and not t.steps[0].terminal)
        result.release()
    return result


def fingerprint(result) -> list:
    return [[(s.action, s.observation, s.behaviour_logprobs, s.policy_logprobs, s.action_ids) for s in t.steps]
            for t in result.trajectories]


def test_group_runs_concurrently_is_written_and_is_deterministic_per_seed(backend, task, tmp_path):
    run = RunDir.create("rollout", "test", root=tmp_path)
    first = run_group(backend, task, seed=5, run=run)
    records = run.records(TRAJECTORIES_FILE)
    assert len(records) == 3 and sorted(r["sibling"] for r in records) == [0, 1, 2]
    assert [r["task_id"] for r in records] == [task.instance_id] * 3
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary == json.loads(json.dumps(first.summary))
    assert summary["trajectories"] == 3 and summary["infra_errors"] == 0 and summary["pass_rate"] is not None
    assert summary["generated_tokens"] == sum(len(s["action_ids"]) for r in records for s in r["steps"])
    assert run.records("metrics.jsonl")[0]["event"] == "rollout"
    # The model saw exactly the token stream the trainer trains on, at every turn.
    assert summary["context_mismatches"] == 0

    again = run_group(backend, task, seed=5)
    assert fingerprint(again) == fingerprint(first)
    assert [t.reward for t in again.trajectories] == [t.reward for t in first.trajectories]
    other = run_group(backend, task, seed=6)
    assert [t[0] for t in fingerprint(other)] != [t[0] for t in fingerprint(first)]
    # The group's siblings sample differently from each other.
    assert len({tuple(s[0] for s in t) for t in fingerprint(first)}) > 1


def test_seeds_and_bad_input():
    assert sample_seed(1, 0) == sample_seed(1, 0) != sample_seed(1, 1) != sample_seed(2, 1)
    with pytest.raises(CRRError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(CRRError, match="workers"):
        ThreadWorkerPool(0)
    with pytest.raises(CRRError, match="no tasks"):
        rollout([], None, None, None)


def test_cli_rollout_end_to_end(task, tmp_path):
    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    args = ["rollout", "--tasks", str(tasks), "--n", "5", "--group-size", "2", "--max-turns", "3",
            "--max-new-tokens", "40", "--max-value-chars", "4", "--temperature", "1.0", "--seed", "1", "--workers", "2",
            "--out", str(tmp_path / "runs")]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["summary"]["trajectories"] == 2 and len(out["trajectories"]) == 2
    assert all(1 <= len(t["steps"]) <= 3 and t["reward"] in (0.0, 1.0) for t in out["trajectories"])
    run_dir = RunDir.open(out["summary"]["run_dir"])
    assert len(run_dir.records(TRAJECTORIES_FILE)) == 2 and run_dir.config["group_size"] == 2
    assert run_dir.path.name.endswith("-rollout-n1-g2-seed1")   # the tasks it rolled out (--n 5 of a set of one)

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "calc-1 #0" in result.stdout and "calc-1 #1" in result.stdout and "pass rate" in result.stdout
    # crr view shows a rollout as an evaluation whose samples are the siblings (the page's data block)
    view = CliRunner().invoke(app, ["view", str(run_dir.path), "--out", str(tmp_path / "v.html")])
    assert view.exit_code == 0, view.output
    page = (tmp_path / "v.html").read_text()
    [shown] = json.loads(page[page.index("{\"runs\""):page.index("</script>", page.index("{\"runs\""))])["runs"]
    assert shown["kind"] == "eval" and shown["label"] == "rollout-n1-g2-seed1" and shown["scored"] == 2
    assert [(r["instance_id"], r["sample"], r["reward"], len(r["steps"])) for r in shown["results"]] == \
        [(t["task_id"], t["sibling"], t["reward"], len(t["steps"])) for t in out["trajectories"]]
    bad = CliRunner().invoke(app, ["rollout", "--tasks", str(tmp_path / "missing.jsonl")])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_an_interrupted_rollout_resumes_and_plays_each_trajectory_once(task, tmp_path):
    from crr.rollout import start_rollout
    from crr.rundir import release_locks

    tasks = write_tasks([task], tmp_path / "tasks.jsonl")
    job = start_rollout(str(default_model_dir()), str(tasks), 1, tmp_path / "runs", group_size=3, seed=2, workers=2,
                        temperature=1.0, max_turns=3, max_new_tokens=40, max_value_chars=4)

    def interrupt(_):
        raise KeyboardInterrupt   # as SIGINT would, once the first trajectory is written

    with pytest.raises(KeyboardInterrupt):
        job.execute(on_trajectory=interrupt)
    release_locks()   # the interrupted process is gone
    first = job.run.records(TRAJECTORIES_FILE)
    assert len(first) == 1 and not (job.run.path / "summary.json").exists()

    # other settings beside --resume are refused before anything runs
    refused = CliRunner().invoke(app, ["rollout", "--resume", str(job.run.path), "--n", "2", "--seed", "3"])
    assert refused.exit_code == 2 and "keeps the settings it was started with; drop --n, --seed" in refused.output
    result = CliRunner().invoke(app, ["rollout", "--resume", str(job.run.path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    records = job.run.records(TRAJECTORIES_FILE)
    assert sorted(r["sibling"] for r in records) == [0, 1, 2] and records[0] == first[0]   # each once, the first kept
    assert out["summary"]["trajectories"] == 3 and out["summary"]["played"] == 2
    assert [t["sibling"] for t in out["trajectories"]] == [0, 1, 2]
    assert json.loads((job.run.path / "summary.json").read_text())["trajectories"] == 3
    # a finished rollout resumes to the same result, playing nothing
    again = CliRunner().invoke(app, ["rollout", "--resume", str(job.run.path), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["summary"]["played"] == 0
    assert len(job.run.records(TRAJECTORIES_FILE)) == 3
    other = RunDir.create("eval", "x", root=tmp_path / "runs")
    release_locks()
    wrong = CliRunner().invoke(app, ["rollout", "--resume", str(other.path)])
    assert wrong.exit_code == 2 and "is a `crr eval` run, not a rollout" in wrong.output


def test_rollout_bench_with_and_without_prefix_reuse():
    args = ["rollout", "bench", "--only", "throughput", "--group", "2", "--max-turns", "3", "--max-new-tokens", "40",
            "--max-value-chars", "4", "--threads", "1"]
    result = CliRunner().invoke(app, [*args, "--prefix-cache", "both", "--json"])
    assert result.exit_code == 0, result.output
    on, off = (json.loads(result.stdout)[k] for k in ("throughput", "throughput_no_prefix_cache"))
    # the same trajectories either way: reuse changes the cost of a turn, not what is sampled
    assert (on["generated_tokens"], on["steps"]) == (off["generated_tokens"], off["steps"])
    assert on["prompt_tokens_reused"] > 0 and off["prompt_tokens_reused"] == 0
    result = CliRunner().invoke(app, [*args, "--prefix-cache", "maybe"])
    assert result.exit_code == 2 and "on, off or both" in result.output


def test_rollout_bench_forks_its_whole_default_script_exactly():
    """The fork part at its defaults (a 45-step script, forks at t = 5 and 40): the script plays whole (the
    tokenizer's window once cut it at 23 steps, its run_tests outputs filling it) and every restore is exact."""
    result = CliRunner().invoke(app, ["rollout", "bench", "--only", "fork", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    fork = json.loads(result.stdout)["fork"]
    assert fork["steps"] == 45 and sorted(map(int, fork["at"])) == [5, 40]
    assert all(r["restore_exact"] for r in fork["at"].values())
    refused = CliRunner().invoke(app, ["rollout", "bench", "--only", "fork", "--repeats", "0"])
    assert refused.exit_code == 2 and "at least 1 repeat" in refused.output, refused.output
    refused = CliRunner().invoke(app, ["rollout", "bench", "--only", "fork", "--fork-steps", "10"])
    assert refused.exit_code == 2 and "--fork-steps must be at least 42, got 10" in refused.output, refused.output


def test_branches_reuse_the_cached_prefix_and_a_failed_round_leaves_no_sandbox(backend, task, tmp_path):
    """Branches (crr.train.counterfactual.run_branches) prefill only what is new in them: the conversation
    up to s_t comes from the rollout's prefix cache. Their restores run beside the proposals and their
    verifier beside the next round; a round whose generation fails closes every sandbox (those of branches
    being verified at that moment too)."""

    class FailingRound:   # the backend, with its second call (the first continuation round) failing
        def __init__(self):
            self.calls = 0

        def generate(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("generation failed")
            return backend.generate(*args, **kwargs)

    ledger = Ledger(RunDir.create("train", "branches", root=tmp_path), writer=False)
    ledger.begin(0)
    pool = ThreadWorkerPool(2)
    try:
        with get_engine("local") as engine:
            result = rollout([task], backend, engine, backend.tokenizer,
                             RolloutConfig(group_size=2, seed=5, workers=2, episode=CONFIG))
            trajs = result.trajectories
            picks = {i: [Selection(0, 0.0)] for i, t in enumerate(trajs) if len(t.steps) > 1}
            assert picks
            args = {"cf_samples": 2, "engine": engine, "tokenizer": backend.tokenizer, "episode": CONFIG,
                    "proposal": "on_policy", "cf_temperature": 1.0, "seed": 3, "horizon": None, "pool": pool,
                    "ledger": ledger}
            cache = backend.prefix_cache
            reused, prefilled = cache.reused_tokens, cache.prefilled_tokens
            branches = run_branches(trajs, picks, backend=backend, **args)
            assert len(branches) == 2 * len(picks) and all(b.reward is not None for b in branches)
            # the proposals' prompts are the first prompts of their trajectories: all but their last token reused
            first = sum(len(trajs[b.row].prompt_ids) for b in branches)
            assert cache.reused_tokens - reused >= first - len(branches)
            assert cache.prefilled_tokens - prefilled < cache.reused_tokens - reused
            assert ledger.current["cf_rollout_s"] > 0 and ledger.current["cf_test_s"] > 0

            with pytest.raises(RuntimeError, match="generation failed"):
                run_branches(trajs, picks, backend=FailingRound(), **args)
            assert not engine._sandboxes, "a branch's sandbox outlived the failed round"
            result.release()
    finally:
        pool.close()


def test_live_forks_start_in_the_rollout_and_keep_the_selectors_picks(backend, task, tmp_path):
    """Forks started during the rollout (crr.train.counterfactual.LiveForks, forks_during_rollout=true): each
    realised step the selector picks from its trajectory so far is forked before the next round, and its
    branches play in the rollout's own rounds; after the rollout the final picks keep theirs (each a fork
    of s_t: the parent's prefix, then its own a_t~), the other forks are discarded. A failing round closes
    the branches' sandboxes too."""
    ledger = Ledger(RunDir.create("train", "live", root=tmp_path), writer=False)
    params = SelectorParams(k=1, eta=0.0)
    pool = ThreadWorkerPool(2)
    rounds = []   # per round: (rows that played, branches among them)

    class Failing:   # the backend, with its n-th generate call failing
        def __init__(self, fail_at=None):
            self.fail_at, self.calls = fail_at, 0

        def generate(self, *args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("generation failed")
            return backend.generate(*args, **kwargs)

        def __getattr__(self, name):   # the prefix cache and the rest
            return getattr(backend, name)

    try:
        with get_engine("local") as engine:
            def live(gen):
                return LiveForks(forks="counterfactual", selector="entropy_type", params=params, cf_samples=2,
                                 proposal="tempered", cf_temperature=1.0, horizon=None, backend=gen, engine=engine,
                                 tokenizer=backend.tokenizer, episode=CONFIG, seed=3, pool=pool)

            forks = live(backend)

            def join(played, ended, gen_s, wait_s):
                rounds.append((len(played), sum(id(e) in forks.episodes for e in played.values())))
                return forks.join(played, ended, gen_s, wait_s)

            ledger.begin(0)
            with ledger.phase("rollout_s"):
                result = rollout([task], backend, engine, backend.tokenizer,
                                 RolloutConfig(group_size=3, seed=5, workers=2, episode=CONFIG), pool=pool, join=join)
            forks.charge(ledger, 0.0)
            trajs = result.trajectories
            picks = {i: select("entropy_type", t.steps, params) for i, t in enumerate(trajs) if t.reward is not None}
            branches = forks.branches(picks)
            assert len(branches) == 2 * sum(map(len, picks.values())) > 0
            assert {(b.row, b.t) for b in branches} | {(b.row, b.t) for b in forks.discarded} == set(forks.launched)
            for b in branches:
                parent = trajs[b.row]
                assert [s.action for s in b.traj.steps[:b.t]] == [s.action for s in parent.steps[:b.t]]
                assert b.sample is None or b.traj.steps[b.t].action == b.sample.text != parent.steps[b.t].action
                assert b.traj is None or b.traj.end_reason is not None
            # branches decoded beside on-policy rows, in the rollout's rounds
            assert any(0 < mine < n for n, mine in rounds), rounds
            assert 0 < ledger.current["cf_rollout_s"] and 0 < ledger.current["rollout_s"]
            # a fork the final choice does not hold is discarded, with its tokens
            assert forks.branches({}) == [] and len(forks.discarded) == 2 * len(forks.launched)
            result.release()

            failing = live(Failing(fail_at=1))   # its first proposal round
            with pytest.raises(RuntimeError, match="generation failed"):
                rollout([task], backend, engine, backend.tokenizer,
                        RolloutConfig(group_size=3, seed=5, workers=2, episode=CONFIG), pool=pool, join=failing.join)
            assert failing.launched
            assert not engine._sandboxes, "a sandbox outlived the failed proposal round"
            rounds.clear()
            failing = live(backend)
            with pytest.raises(RuntimeError, match="generation failed"):   # a round with branches in it
                rollout([task], Failing(fail_at=2), engine, backend.tokenizer,
                        RolloutConfig(group_size=3, seed=5, workers=2, episode=CONFIG), pool=pool, join=failing.join)
            assert failing.episodes
            assert not engine._sandboxes, "a sandbox outlived the failed round"
    finally:
        pool.close()


def test_a_branch_a_sibling_played_takes_its_return_unplayed(backend, task, tmp_path):
    """A branch whose a_t~ a sibling took in the same state (crr.train.counterfactual.played_by, reuse_played)
    takes the sibling's trajectory and return, with no fork played; a sibling stands for one branch at most. Every
    sibling starts in s_0; the proposal round here returns another sibling's a_0 (its realised tokens)."""
    ledger = Ledger(RunDir.create("train", "played", root=tmp_path), writer=False)
    ledger.begin(0)
    pool = ThreadWorkerPool(2)

    class Proposing:   # the backend, its first call (the proposal round) answered with `sources`' a_0
        def __init__(self, sources):
            self.sources, self.calls = sources, 0

        def generate(self, *args, **kwargs):
            out = backend.generate(*args, **kwargs)
            self.calls += 1
            if self.calls == 1 and self.sources:
                out = [dataclasses.replace(s, text=trajs[j].steps[0].action,
                                           action_ids=list(trajs[j].steps[0].action_ids))
                       for s, j in zip(out, self.sources)]
            return out

        def __getattr__(self, name):
            return getattr(backend, name)

    try:
        with get_engine("local") as engine:
            result = rollout([task], backend, engine, backend.tokenizer,
                             RolloutConfig(group_size=3, seed=5, workers=2, episode=CONFIG))
            trajs = result.trajectories
            rows = [i for i, t in enumerate(trajs) if t.reward is not None and not t.steps[0].terminal]
            assert rows
            picks = {i: [Selection(0, 0.0)] for i in rows}
            sources = [(i + 1) % len(trajs) for i in rows]
            args = {"cf_samples": 1, "engine": engine, "tokenizer": backend.tokenizer, "episode": CONFIG,
                    "proposal": "on_policy", "cf_temperature": 1.0, "seed": 3, "horizon": None, "pool": pool,
                    "ledger": ledger}
            reused = run_branches(trajs, picks, backend=Proposing(sources), reuse_played=True, **args)
            assert [b.played_by for b in reused] == sources and [b.traj for b in reused] == [trajs[j] for j in sources]
            assert [b.reward for b in reused] == [trajs[j].reward for j in sources]
            assert [b.tokens for b in reused] == [len(trajs[j].steps[0].action_ids) for j in sources]
            assert [b.observed_tokens for b in reused] == [0] * len(rows)   # nothing was fed: nothing is new
            assert not engine._sandboxes
            # without reuse_played the same proposals are played: forked at s_0, the whole episode is new
            played = run_branches(trajs, picks, backend=Proposing(sources), **args)
            assert all(b.played_by is None and b.traj is not trajs[j] and b.reward is not None
                       for b, j in zip(played, sources))
            assert [(b.tokens, b.observed_tokens) for b in played] == [
                (b.traj.generated_tokens, b.traj.observed_tokens) for b in played]
            assert all(b.observed_tokens > 0 for b in played if len(b.traj.steps) > 1)
            # K = 3 drawing one sibling's action thrice: a sibling stands for one branch (of two siblings at most)
            twice = run_branches(trajs, picks, backend=Proposing([j for j in sources for _ in range(3)]),
                                 reuse_played=True, **{**args, "cf_samples": 3})
            taken, expected = set(), []
            for i, j in zip(rows, sources):
                for _ in range(3):   # the first free sibling that took the proposed a_0, else played
                    free = [m for m, other in enumerate(trajs) if m != i and m not in taken and other.reward is not None
                            and other.steps[0].action_ids == trajs[j].steps[0].action_ids]
                    expected.append(free[0] if free else None)
                    taken.update(free[:1])
            assert [b.played_by for b in twice] == expected and None in expected
            # cut at h = 0 after a_t~: a sibling that went on past a_0 is not such a branch
            cut = run_branches(trajs, picks, backend=Proposing(sources), reuse_played=True, **{**args, "horizon": 0})
            assert [b.played_by for b in cut] == [j if len(trajs[j].steps) == 1 else None for j in sources]
            result.release()
    finally:
        pool.close()


def test_played_by_needs_the_same_state_and_action():
    from crr.agent.episode import Step, Trajectory
    from crr.train.counterfactual import played_by

    def traj(actions, observations="oo", reward=1.0, end="submit", digest=None):
        steps = [Step(t=t, action="", call=None, parse_error=None, observation=o, is_error=False, terminal=False,
                      action_ids=list(a), observation_ids=[ord(o)], span=(0, 0), behaviour_logprobs=[],
                      policy_logprobs=[], entropy=0.0, grammar_rejections=0, truncated=False, tool_type=None,
                      temperature=1.0, sample_seed=None, context_matches=None, gen_s=0.0, exec_s=0.0, digest=digest)
                 for t, (a, o) in enumerate(zip(actions, observations))]
        return Trajectory("task", 0, 0, 0, [], [1, 2], steps, end_reason=end, reward=reward)

    parent = traj([[1], [2]])
    assert played_by([parent, traj([[1], [3]])], 0, 1, [3], None) == 1
    assert played_by([parent, traj([[1], [3]])], 0, 1, [4], None) is None                # another action
    assert played_by([parent, traj([[1], [3]], observations="xo")], 0, 1, [3], None) is None   # another state
    assert played_by([parent, traj([[5], [3]])], 0, 1, [3], None) is None                # another prefix
    assert played_by([parent, traj([[1], [3]], reward=None)], 0, 1, [3], None) is None   # no return
    assert played_by([parent, traj([[1], [3]], end="time_limit")], 0, 1, [3], None) is None
    assert played_by([parent, traj([[1], [3]], digest="d")], 0, 1, [3], None) is None    # other tree digests
    assert played_by([parent, traj([[3], [4]])], 0, 0, [3], 0) is None                  # went on past h = 0
    assert played_by([parent, traj([[3], [4]])], 0, 0, [3], 1) == 1
    assert played_by([parent, traj([[1], [3]])], 0, 1, [3], None, taken={1}) is None     # it stands for another
