"""Advantage arithmetic on hand-built trajectories (crr's own Step/Trajectory): the group advantage, Eq. 3's
per-step contrasts for EVERY selected step of EVERY sample, no advantage on observation tokens, infra rows
excluded (never 0), Search-Select's strict replacement rule, the (B, T) layout aligned with the spans."""

from __future__ import annotations

import pytest
import torch

from crr.agent.episode import Step, Trajectory
from crr.errors import CRRError
from crr.train.advantages import (
    ESTIMATORS,
    RowCredit,
    estimate,
    estimator,
    search_select_choice,
    state_keys,
    token_advantages,
)


def make_traj(lengths: list[tuple[int, int]], reward: float | None, task: int = 0) -> Trajectory:
    """A trajectory whose step t has lengths[t] = (action tokens, observation tokens)."""
    steps, pos = [], 0
    for t, (na, no) in enumerate(lengths):
        steps.append(Step(t=t, action="{}", call=None, parse_error=None, observation="", is_error=False,
                          terminal=False, action_ids=[100 + t] * na, observation_ids=[7] * no, span=(pos, pos + na),
                          behaviour_logprobs=[-0.5] * na, policy_logprobs=[-0.5] * na, entropy=1.0,
                          grammar_rejections=0, truncated=False, tool_type=0.0, temperature=0.6, sample_seed=0,
                          context_matches=True, gen_s=0.0, exec_s=0.0))
        pos += na + no
    return Trajectory(task_id=f"task{task}", task_index=task, sibling=0, seed=0, messages=[], prompt_ids=[1, 2],
                      steps=steps, reward=reward, infra_error=None if reward is not None else "sandbox died")


def credit(traj: Trajectory, selected=(), cf=None) -> RowCredit:
    return RowCredit(group_key=traj.task_index, reward=traj.reward, spans=[s.span for s in traj.steps],
                     selected=list(selected), counterfactuals=cf or {})


# Two tasks x G = 3. Task 0: rewards 1, 0, 1; task 1: 0, 0, infra failure.
TRAJS = [make_traj([(3, 2), (2, 4), (4, 0)], 1.0), make_traj([(2, 3), (3, 0)], 0.0), make_traj([(5, 0)], 1.0),
         make_traj([(2, 2), (2, 0)], 0.0, task=1), make_traj([(3, 0)], 0.0, task=1),
         make_traj([(2, 1), (1, 0)], None, task=1)]


def test_grpo_is_reward_minus_sibling_mean_without_std_scaling_and_excludes_infra():
    adv = estimate("grpo", [credit(t) for t in TRAJS])
    assert adv[0] == pytest.approx([1 / 3] * 3) and adv[1] == pytest.approx([-2 / 3] * 2)
    assert adv[2] == pytest.approx([1 / 3])
    assert adv[3] == [0.0, 0.0] and adv[4] == [0.0]   # the infra row is not a 0 in the task-1 mean
    assert adv[5] is None


def test_crr_every_selected_step_of_every_sample_gets_its_own_contrast():
    rows = [credit(TRAJS[0], [0, 1], {0: [0.0], 1: [1.0]}),          # K = 1
            credit(TRAJS[1], [0, 1], {0: [1.0, 0.0], 1: [0.0, 0.0]}),  # K = 2: mean over K
            credit(TRAJS[2], [0], {}),                                  # fork skipped: group advantage
            credit(TRAJS[3], [1], {1: [1.0]}), credit(TRAJS[4]), credit(TRAJS[5], [0], {0: [1.0]})]
    adv = estimate("crr", rows)
    assert adv[0] == pytest.approx([1.0, 0.0, 1 / 3])    # selected 0 and 1 contrasts, step 2 group
    assert adv[1] == pytest.approx([-0.5, 0.0])
    assert adv[2] == pytest.approx([1 / 3])
    assert adv[3] == pytest.approx([0.0, -1.0]) and adv[4] == [0.0]
    assert adv[5] is None                                # infra: excluded even with forks
    zero = estimate("zero_contrast", rows)
    assert zero[0] == pytest.approx([0.0, 0.0, 1 / 3]) and zero[3] == pytest.approx([0.0, 0.0])
    # the control never forks: every selected step gets 0, with or without counterfactual returns
    assert zero[2] == [0.0] and estimate("zero_contrast", [credit(TRAJS[0], [1]), credit(TRAJS[1])])[0] == \
        pytest.approx([1 / 2, 0.0, 1 / 2])
    # Each forked step carries its own R - R~ (the bug elsewhere: most step samples zeroed); ties give 0.
    contrasts = [adv[i][t] for i, r in enumerate(rows) if adv[i] for t in r.selected if r.counterfactuals.get(t)]
    assert contrasts == pytest.approx([1.0, 0.0, -0.5, 0.0, -1.0])


def test_token_layout_action_tokens_only_and_aligned_with_spans():
    rows = [credit(TRAJS[0], [0, 1], {0: [0.0], 1: [1.0]}), credit(TRAJS[1]), credit(TRAJS[5])]
    adv = estimate("crr", rows)
    length = max(len(t.completion_ids) for t in TRAJS[:2]) + 2   # TRL pads to the longest completion
    tokens = token_advantages(rows, adv, length)
    assert tokens.shape == (3, length)
    for i, traj in enumerate([TRAJS[0], TRAJS[1]]):
        mask = torch.tensor(traj.env_mask + [0] * (length - len(traj.env_mask)), dtype=torch.bool)
        assert torch.all(tokens[i][~mask] == 0)          # observation tokens and padding: none
        for step, a in zip(traj.steps, adv[i]):
            s, e = step.span
            assert traj.completion_ids[s:e] == step.action_ids   # spans index the action tokens
            assert torch.all(tokens[i, s:e] == a)
    assert tokens[0, :3].tolist() == [1.0] * 3 and tokens[0, 3:5].tolist() == [0.0, 0.0]
    assert tokens[0, 5:7].tolist() == [0.0, 0.0] and tokens[0, 11:15].tolist() == pytest.approx([0.5] * 4)  # G = 2 here
    assert torch.all(tokens[2] == 0)                     # the excluded row
    truncated = token_advantages(rows, adv, 6)           # TRL cut the completion: spans clip
    assert truncated[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(CRRError, match="step advantages"):
        token_advantages(rows[:1], [[1.0]], 6)


def test_search_select_replaces_only_on_strictly_higher_return():
    assert search_select_choice(0.0, [0.0, 1.0, 1.0]) == 1     # the first verifier-best fork
    assert search_select_choice(1.0, [1.0, 1.0]) is None        # ties keep the realised sequence
    assert search_select_choice(0.0, [0.0, None]) is None
    assert search_select_choice(None, [1.0]) is None            # an unscored realised row is not replaced
    assert search_select_choice(0.0, []) is None
    rows = [credit(t) for t in TRAJS]
    assert estimate("search_select", rows) == estimate("grpo", rows)
    with pytest.raises(CRRError, match="unknown advantage"):
        estimate("ppo", rows)


def test_gigpo_adds_omega_times_the_step_advantage_within_groups_of_equal_states():
    # task 0, G = 3, rewards 1, 0, 1: all start in s0; rows 0 and 1 then reach state "b", row 2 reaches "c"
    rows = [RowCredit(0, 1.0, [(0, 1)] * 3, state_keys=["s0", "b", "x"]),
            RowCredit(0, 0.0, [(0, 1)] * 2, state_keys=["s0", "b"]),
            RowCredit(0, 1.0, [(0, 1)] * 2, state_keys=["s0", "c"]), RowCredit(1, 0.0, [(0, 1)], state_keys=["s0"]),
            RowCredit(1, None, [(0, 1)], state_keys=["s0"]), RowCredit(1, 1.0, [(0, 1)])]   # no keys: episode only
    adv = estimate("gigpo", rows, omega=0.5)
    e = 1 - 2 / 3                                                       # A^E of rows 0 and 2
    assert adv[0] == pytest.approx([e + 0.5 * e, e + 0.5 * 0.5, e])   # s0: the group's A^E; b: 1 - 1/2; x alone
    assert adv[1] == pytest.approx([-2 / 3 + 0.5 * -2 / 3, -2 / 3 + 0.5 * -0.5])
    assert adv[2] == pytest.approx([e + 0.5 * e, e])                   # c: a group of one
    assert adv[3] == pytest.approx([-0.5]) and adv[4] is None and adv[5] == pytest.approx([0.5])  # infra row left out
    assert estimate("gigpo", [RowCredit(r.group_key, r.reward, r.spans) for r in rows]) == estimate("grpo", rows)


def test_mc_values_is_the_difference_of_successive_monte_carlo_values():
    rows = [RowCredit(0, 1.0, [(0, 1)] * 3, continuations={0: [0.0, 1.0], 1: [1.0, 1.0]}),   # t = 2: submit, no forks
            RowCredit(0, 0.0, [(0, 1)] * 2, continuations={0: [1.0], 1: [0.0, 0.0]}), RowCredit(0, None, [(0, 1)])]
    adv = estimate("mc_values", rows)
    assert adv[0] == pytest.approx([0.5, 0.0, 0.0])       # V = 0.5, 1, (1), R = 1
    assert adv[1] == pytest.approx([-1.0, 0.0]) and adv[2] is None


def test_resets_is_grpo_within_the_rows_of_one_reset_state_on_the_steps_each_sampled():
    # task 0: two on-policy rows (1, 0) and two restart rows reset to step 1 of a failed sibling (1, 0);
    # task 1: both on-policy rows failed, two restart rows from step 2 (0 and an infra failure); task 2: nothing
    # failed, so its "restart" rows are fresh samples from s_0 (reset 0) and join its on-policy group
    rows = [RowCredit(0, 1.0, [(0, 1)] * 3), RowCredit(0, 0.0, [(0, 1)] * 3),
            RowCredit(0, 1.0, [(0, 1)] * 3, reset=1), RowCredit(0, 0.0, [(0, 1)] * 4, reset=1),
            RowCredit(1, 0.0, [(0, 1)] * 3), RowCredit(1, 0.0, [(0, 1)] * 3),
            RowCredit(1, 0.0, [(0, 1)] * 4, reset=2), RowCredit(1, None, [(0, 1)] * 3, reset=2),
            RowCredit(2, 1.0, [(0, 1)] * 2), RowCredit(2, 1.0, [(0, 1)] * 2), RowCredit(2, 0.0, [(0, 1)] * 2)]
    adv = estimate("resets", rows)
    assert adv[0] == pytest.approx([0.5] * 3) and adv[1] == pytest.approx([-0.5] * 3)      # GRPO among the on-policy
    assert adv[2] == pytest.approx([0.0, 0.5, 0.5]) and adv[3] == pytest.approx([0.0, -0.5, -0.5, -0.5])
    assert adv[4:7] == [[0.0] * 3, [0.0] * 3, [0.0] * 4] and adv[7] is None     # all-fail groups: no signal
    assert adv[8:] == [pytest.approx([1 / 3] * 2)] * 2 + [pytest.approx([-2 / 3] * 2)]  # one group from s_0
    # on rows that were all sampled from s_0 it is GRPO
    plain = [RowCredit(r.group_key, r.reward, r.spans) for r in rows]
    assert estimate("resets", plain) == estimate("grpo", plain)


def test_estimators_register_by_decorator_or_dotted_path_and_check_their_params(tmp_path, monkeypatch):
    @estimator("toy")
    def toy(rows, scale: float = 1.0):
        return [[scale] * len(r.spans) for r in rows]

    try:
        rows = [credit(TRAJS[1])]
        assert estimate("toy", rows) == [[1.0, 1.0]] and estimate("toy", rows, scale=2.0) == [[2.0, 2.0]]
        with pytest.raises(CRRError, match="does not take advantage_params"):
            estimate("toy", rows, omega=1.0)
    finally:
        del ESTIMATORS["toy"]
    (tmp_path / "outside_crr.py").write_text("def half(rows):\n    return [[0.5] * len(r.spans) for r in rows]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert estimate("outside_crr:half", [credit(TRAJS[1])]) == estimate("outside_crr.half", [credit(TRAJS[1])]) == \
        [[0.5, 0.5]]
    for bad, why in [("outside_crr:nope", "has no"), ("no_such_module_xyz.fn", "cannot import"), ("ppo", "unknown")]:
        with pytest.raises(CRRError, match=why):
            estimate(bad, [])


def test_state_keys_are_the_tree_digest_and_the_observations_so_far():
    def traj(digests, observations):
        t = make_traj([(1, 1)] * len(digests), 1.0)
        for s, d, o in zip(t.steps, digests, observations):
            s.digest, s.observation = d, o
        return t.steps

    a = state_keys(traj(["d0", "d1", "d1"], ["ls", "x", "y"]))
    b = state_keys(traj(["d0", "d1", "d1"], ["ls", "z", "y"]))
    assert a[:2] == b[:2] and a[2] != b[2]              # same tree, different observation history at s_2
    assert state_keys(traj(["d0", "d2"], ["ls", "x"]))[1] != a[1]                      # another tree
    assert len(set(a)) == 3 and state_keys(traj(["d0", None], ["ls", "x"])) == []     # a missing digest: unknown
