"""Selectors and proposals: the shared eligible set, Eq. 4, the k cap, seeded random, stride; the
proposal never returns the realised action (fake backend for the control flow, the real tiny model for
the rejection sampler)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from crr.agent.conversation import initial_messages
from crr.errors import CRRError
from crr.policy.backend import StepSample, TransformersBackend
from crr.policy.model import default_model_dir, load_policy
from crr.train.proposals import get_proposal
from crr.train.selectors import (
    PREFIX_SELECTORS,
    SELECTORS,
    STATE_SELECTORS,
    Context,
    SelectorParams,
    eligible,
    score,
    select,
    sibling_values,
)


@dataclass
class S:
    entropy: float
    tool_type: float | None
    terminal: bool = False


# t:        0 view  1 edit  2 low-H  3 invalid 4 shell 5 tests 6 edit  7 submit
STEPS = [S(0.9, 0.0), S(0.8, 1.0), S(0.1, 1.0), S(2.0, None), S(0.7, 0.75), S(1.0, 0.25), S(0.5, 1.0),
         S(3.0, None, terminal=True)]
P = SelectorParams(k=3, eta=0.4, lambda_type=0.6)


def test_eligible_set_excludes_terminal_invalid_and_low_entropy():
    assert eligible(STEPS, 0.4) == [0, 1, 4, 5, 6]


def test_entropy_type_is_top_k_of_eq4():
    chosen = select("entropy_type", STEPS, P)
    # scores: 0.9, 1.28, -, -, 1.015, 1.15, 0.8 -> top 3 = steps 1, 5, 4
    assert [c.t for c in chosen] == [1, 4, 5]
    assert chosen[0].score == pytest.approx(0.8 * 1.6)
    assert all(c.score == pytest.approx(score(STEPS[c.t], 0.6)) for c in chosen)


def test_other_selectors_share_the_eligible_set_and_cap():
    assert [c.t for c in select("entropy", STEPS, P)] == [0, 1, 5]
    assert [c.t for c in select("type", STEPS, P)] == [1, 4, 6]
    assert [c.t for c in select("stride", STEPS, P)] == [0, 4, 6]
    rng_picks = [c.t for c in select("random", STEPS, P, np.random.default_rng(11))]
    assert rng_picks == [c.t for c in select("random", STEPS, P, np.random.default_rng(11))]  # seeded
    for name in sorted(set(SELECTORS) - STATE_SELECTORS):   # those two keep only some eligible steps (below)
        picks = [c.t for c in select(name, STEPS, P, np.random.default_rng(0))]
        assert len(picks) == 3 and set(picks) <= {0, 1, 4, 5, 6} and picks == sorted(picks), name
        few = [c.t for c in select(name, STEPS, SelectorParams(k=3, eta=0.85), np.random.default_rng(0))]
        assert few == [0, 5], name                      # fewer eligible than k: all of them, no more
        assert select(name, STEPS, SelectorParams(k=0), np.random.default_rng(0)) == []


def test_prefix_selectors_choose_among_their_prefixes_choices(monkeypatch):
    """What lets a fork start as its step is realised (crr.train.counterfactual.LiveForks): for a selector in
    PREFIX_SELECTORS, a step the selector picks from a whole trajectory is in its pick from every prefix that
    holds it. Checked on random trajectories; a selector of the middle eligible step is the counter-example
    that shows the check can fail."""
    monkeypatch.setitem(SELECTORS, "middle", lambda steps, pool, p, rng, ctx: pool[len(pool) // 2:][:1])
    rng = np.random.default_rng(0)

    def prefix_closed(name, steps, params):
        final = {c.t for c in select(name, steps, params)}
        return all(t in {c.t for c in select(name, steps[:t + 1], params)} for t in final)

    broken = 0
    for _ in range(300):
        n = int(rng.integers(1, 12))
        steps = [S(float(rng.choice([0.2, 0.5, 0.9, 1.3])), rng.choice([None, 0.0, 0.25, 0.75, 1.0]))
                 for _ in range(n)]
        params = SelectorParams(k=int(rng.integers(1, 4)), eta=0.4)
        for name in PREFIX_SELECTORS:
            assert prefix_closed(name, steps, params), (name, steps, params)
        broken += not prefix_closed("middle", steps, params)
    assert broken > 0


def test_mid_value_forks_where_siblings_through_the_state_both_succeed_and_fail():
    # task 0, G = 4: every row starts in state a; rows 0 and 1 reach b, row 2 reaches c, row 3 reaches d then
    # b. Rewards 1, 0, 1, 0 -> p(a) = 1/2, p(b) = 1/3 (rows 0, 1, 3), p(c) = 1, p(d) = 0; task 1 is apart.
    keys = [["a", "b", "x"], ["a", "b"], ["a", "c"], ["a", "d", "b"], ["a"]]
    values = sibling_values(keys, [1.0, 0.0, 1.0, 0.0, 0.0], [0, 0, 0, 0, 1])
    assert values[0] == pytest.approx([0.5, 1 / 3, 1.0]) and values[2] == pytest.approx([0.5, 1.0])
    assert values[3] == pytest.approx([0.5, 0.0, 1 / 3]) and values[4] == [0.0]   # another task: its own p
    assert sibling_values([["a"], []], [None, 1.0], [0, 0]) == [[None], []]      # unscored: no estimate
    steps = [S(0.9, 0.0), S(0.8, 1.0), S(1.0, 0.0)]
    chosen = select("mid_value", steps, SelectorParams(k=1), context=Context(1.0, values[0]))
    assert [c.t for c in chosen] == [0]                 # closest to 1/2; step 2 (p = 1) never
    assert [c.t for c in select("mid_value", steps, SelectorParams(k=3), context=Context(1.0, values[0]))] == [0, 1]
    assert select("mid_value", steps[:2], SelectorParams(k=3), context=Context(1.0, [0.0, 1.0])) == []
    with pytest.raises(CRRError, match="mid_value"):
        select("mid_value", steps, P)


@dataclass
class D(S):
    digest: str | None = None


def test_first_edit_of_failure_is_the_first_step_that_changed_the_repository():
    # recorded digests: step 1 (a shell command) changed the tree, step 2 (an edit) too
    steps = [D(0.9, 0.0, digest="a"), D(0.8, 0.75, digest="a"), D(0.8, 1.0, digest="b"), D(0.9, 0.0, digest="c"),
             D(1.0, None, terminal=True, digest="c")]
    assert [c.t for c in select("first_edit_of_failure", steps, P, context=Context(0.0))] == [1]
    assert select("first_edit_of_failure", steps, P, context=Context(1.0)) == []     # a success: nothing
    assert select("first_edit_of_failure", steps, SelectorParams(k=0), context=Context(0.0)) == []
    # without digests: the first eligible edit_file call (step 2 of STEPS has H below eta)
    assert [c.t for c in select("first_edit_of_failure", STEPS, P, context=Context(0.0))] == [1]
    assert select("first_edit_of_failure", STEPS[:1], P, context=Context(0.0)) == []


def test_reset_points_are_one_state_per_task_of_its_first_failure_with_a_pick():
    from types import SimpleNamespace as T

    from crr.train.counterfactual import reset_points
    from crr.train.selectors import Selection

    trajs = [
        T(task_index=0, reward=1.0, snapshots={0: "s"}), T(task_index=0, reward=0.0, snapshots={0: "s"}),  # no pick
        T(task_index=0, reward=0.0, snapshots={0: "s"}), T(task_index=0, reward=0.0, snapshots={0: "s"}),
        T(task_index=1, reward=1.0, snapshots={}), T(task_index=1, reward=None, snapshots={0: "s"}),   # no failure
        T(task_index=2, reward=1.0, snapshots={}), T(task_index=2, reward=1.0, snapshots={})]          # no s_0 kept
    picks = {0: [Selection(1, 2.0)], 2: [Selection(2, 1.0), Selection(3, 0.5)], 3: [Selection(1, 1.0)],
             4: [Selection(1, 1.0)]}
    resets, fresh = reset_points(trajs, picks)
    assert resets == {2: [Selection(2, 1.0)]}            # a success's pick and a failure without one are passed over
    assert fresh == {5: [Selection(0, 0.0)]}              # task 1: fresh rows from s_0; task 2: neither


def test_random_is_uniform_over_the_eligible_set():
    rng = np.random.default_rng(0)
    counts = np.zeros(len(STEPS))
    for _ in range(2000):
        for c in select("random", STEPS, SelectorParams(k=2), rng):
            counts[c.t] += 1
    assert counts[[2, 3, 7]].sum() == 0
    assert np.allclose(counts[[0, 1, 4, 5, 6]] / 2000, 2 / 5, atol=0.05)


def test_bad_selector_input():
    with pytest.raises(CRRError, match="unknown selector"):
        select("best", STEPS, P)
    with pytest.raises(CRRError, match="rng"):
        select("random", STEPS, P)
    with pytest.raises(CRRError, match="k must be"):
        SelectorParams(k=-1)


def _sample(text: str, **kw) -> StepSample:
    return StepSample(text=text, prompt_ids=[], action_ids=[1], behaviour_logprobs=[-1.0], policy_logprobs=[-1.0],
                      entropies=[1.0], semantic=[True], entropy=1.0, grammar_rejections=0, temperature=0.7,
                      wall_time_s=0.0, truncated=False, proposal_logprob=-1.0, **kw)


class ScriptedBackend:
    """Returns queued texts in order and records the calls (the proposal's control flow only)."""

    def __init__(self, texts: list[str]):
        self.texts, self.calls = list(texts), []

    def generate(self, conversations, temperature, seed, max_new_tokens, exclude=None, exclude_ids=None):
        self.calls.append((len(conversations), seed, exclude, exclude_ids))
        out = []
        for ex in exclude:
            text = self.texts.pop(0)
            out.append(_sample(text, exclusion_failed=text == ex))
        return out


VIEW = '{"name": "view_file", "arguments": {"path": "a.py"}}'
OTHER = '{"name": "view_file", "arguments": {"path": "b.py"}}'
BROKEN = '{"name": "view_file", "arguments": {"path": 3}}'


def test_tempered_skips_when_exclusion_fails_and_validity_filter_resamples():
    backend = ScriptedBackend([VIEW, OTHER])
    out = get_proposal("tempered")(backend, [[], []], [VIEW, VIEW], [[7], [8]], temperature=0.7, seed=1,
                                   max_new_tokens=8)
    assert out[0] is None and out[1].text == OTHER
    assert backend.calls[0][2:] == ([VIEW, VIEW], [[7], [8]])   # the realised action and its tokens are excluded
    backend = ScriptedBackend([BROKEN, BROKEN, OTHER, BROKEN, BROKEN, BROKEN])
    out = get_proposal("validity_filtered")(backend, [[], []], [VIEW, VIEW], [[7], [8]], temperature=0.7, seed=1,
                                            max_new_tokens=8)
    assert out[0].text == OTHER                          # resampled once, then valid
    assert out[1] is None                                # invalid after 3 resamples: skipped
    assert len(backend.calls) == 4 and len({c[1] for c in backend.calls}) == 4
    with pytest.raises(CRRError, match="T_cf"):
        get_proposal("tempered")(backend, [[]], [VIEW], [[7]], temperature=0.0, seed=1, max_new_tokens=8)
    with pytest.raises(CRRError, match="unknown proposal"):
        get_proposal("best_of")


def test_real_proposal_never_returns_the_realised_action(make_task):
    backend = TransformersBackend(*load_policy(default_model_dir()), max_value_chars=4)
    task = make_task({"a.py": "x = 1\n"}, problem_statement="fix a.py")
    conv = initial_messages(task, "/testbed")
    played = 0
    for seed in range(3):
        realised = backend.generate([conv], temperature=0.7, seed=seed, max_new_tokens=40)[0]
        if realised.truncated:
            continue
        played += 1
        out = get_proposal("tempered")(backend, [conv], [realised.text], [realised.action_ids], temperature=0.7,
                                       seed=seed, max_new_tokens=40)[0]
        assert out is None or (out.text != realised.text and np.isfinite(out.proposal_logprob))
        if out is not None:   # q(a) is the realised tokens' own, as their sample recorded it
            assert out.excluded_logprob == pytest.approx(sum(realised.behaviour_logprobs), abs=1e-4)
    assert played
