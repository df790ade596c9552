"""The conversation's token layout and the episode loop: prefix consistency against the chat template and
TRL's own suffix computation, episodes of the real tiny model in real local sandboxes (bad and truncated
calls, the turn cap, infrastructure failures), and forking a trajectory at step t."""

from __future__ import annotations

import json
import types

import pytest
from trl import GRPOTrainer

from crr.agent.conversation import (
    Conversation,
    action_text,
    call_json,
    initial_messages,
    observation_ids,
    render_ids,
    render_text,
)
from crr.agent.episode import Episode, EpisodeConfig, Trajectory, fork_at, replay_at
from crr.agent.expert import expert_script
from crr.errors import CRRError, SandboxError
from crr.policy.backend import TransformersBackend
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import default_model_dir, load_policy
from crr.policy.scripted import ScriptedBackend
from crr.sandbox.base import tree_digest
from crr.rollout import run_episode, summarise




@pytest.fixture(scope="module")
def policy():
    return load_policy(default_model_dir())  # built once per test session into its crr cache


@pytest.fixture(scope="module")
def tokenizer(policy):
    return policy[1]


@pytest.fixture(scope="module")
def backend(policy):
    return TransformersBackend(*policy, max_value_chars=4)  # short strings: complete calls from an untrained model


def expert_calls(task) -> list[str]:
    return [action_text(c) for c in expert_script(task)]


# ----------------------------------------------------------------------------- the conversation

OBSERVATIONS = ["calc.py: lines 1-5 of 5\n     1\tdef add(a, b):\n[exit code: 0]",
                "Error: ünïcode path ✓ does not exist", "", "x" * 300]


def test_token_stream_equals_the_rendering_of_the_whole_conversation(tokenizer, task):
    calls = [*expert_calls(task)[:3], '{"name": "view_fi', '{"name": "nope", "arguments": {}}',
             '{"name": "run_shell", "arguments": {"command": "echo \\u00e9 \\"q\\""}}', expert_calls(task)[-1]]
    conv = Conversation(tokenizer, initial_messages(task, "/testbed", max_turns=7))
    assert conv.prompt_ids == tokenizer.apply_chat_template(conv.messages, tools=conv.tools, add_generation_prompt=True,
                                                               return_dict=False)
    for k, text in enumerate(calls):
        truncated = text.endswith("view_fi")
        # A truncated call has no end-of-turn token: the environment closes the turn.
        ids = tokenizer.encode("<tool_call>\n" + text, add_special_tokens=False) if truncated else None
        conv.add_action(text, ids)
        closing = [tokenizer.eos_token_id] if truncated else []  # added with the observation
        assert render_ids(tokenizer, conv.messages) == conv.token_ids() + closing  # after every action...
        if k < len(calls) - 1:
            obs = conv.add_observation(OBSERVATIONS[k % len(OBSERVATIONS)], "view_file")
            assert obs[0] == tokenizer.eos_token_id if truncated else obs[0] != tokenizer.eos_token_id
            assert render_ids(tokenizer, conv.messages) == conv.token_ids()  # ...and every observation
    assert tokenizer.decode(conv.token_ids()) == render_text(tokenizer, conv.messages)
    # Structured calls render the generated JSON verbatim (escapes kept); others as raw text.
    assert conv.messages[2]["tool_calls"][0]["function"]["name"] == "run_tests"
    assert conv.messages[-3]["tool_calls"][0]["function"]["arguments"] == '{"command": "echo \\u00e9 \\"q\\""}'
    assert conv.messages[8] == {"role": "assistant", "content": '<tool_call>\n{"name": "view_fi'}
    # Layout: spans cover exactly the actions, the mask is 1 on them and 0 elsewhere.
    assert len(conv.spans) == len(calls) and len(conv.env_mask) == len(conv.completion_ids)
    for (start, end), text in zip(conv.spans, calls):
        assert call_json(tokenizer.decode(conv.completion_ids[start:end], skip_special_tokens=True)) == text
        assert conv.env_mask[start:end] == [1] * (end - start)
    assert sum(conv.env_mask) == sum(e - s for s, e in conv.spans)
    assert conv.completion_ids[-1] == tokenizer.eos_token_id  # it ends with the last action
    for t in range(len(calls) + 1):  # the context of a_t is the rendering of the messages before it
        assert conv.context_ids(t) == render_ids(tokenizer, conv.messages_at(t))
    with pytest.raises(CRRError, match="add the observation first"):
        conv.add_action(calls[0])
    with pytest.raises(CRRError, match="outside"):
        conv.context_ids(len(calls) + 1)


def test_observation_ids_are_trls_tool_suffix(tokenizer):
    """The trainer built on TRL gets the same observation tokens its own tool loop would append."""
    trainer = types.SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None,
                                    chat_template_kwargs={"tools": Conversation(tokenizer, [
                                        {"role": "user", "content": "x"}]).tools}, _is_vlm=False)
    for text in OBSERVATIONS:
        message = {"role": "tool", "name": "run_shell", "content": text}
        assert observation_ids(tokenizer, message) == GRPOTrainer._get_tool_suffix_ids(trainer, [message])


def test_sampler_tokenization_keeps_the_text_and_its_own_ids(tokenizer, task):
    """Actions tokenized as the constrained sampler emits them (the grammar forces structure in pieces):
    the stream keeps those ids and still decodes to the chat template's text."""
    grammar = ToolCallGrammar(tokenizer)
    conv = Conversation(tokenizer, initial_messages(task, "/testbed"))
    calls = expert_calls(task)
    for text in calls[:-1]:
        ids = grammar.tokenize(text)
        conv.add_action(text, ids)
        assert conv.completion_ids[conv.spans[-1][0]:] == ids
        conv.add_observation("ok", json.loads(text)["name"])
    assert tokenizer.decode(conv.token_ids()) == render_text(tokenizer, conv.messages)
    with pytest.raises(CRRError, match="starts with its system and user"):
        Conversation(tokenizer, [])


# ----------------------------------------------------------------------------- episodes

def check_layout(traj: Trajectory, generated: bool = True) -> None:
    completion, mask = traj.completion_ids, traj.env_mask
    assert len(completion) == len(mask)
    for s in traj.steps:
        start, end = s.span
        assert completion[start:end] == s.action_ids and mask[start:end] == [1] * len(s.action_ids)
        assert len(s.behaviour_logprobs) == len(s.policy_logprobs) == (len(s.action_ids) if generated else 0)
        assert completion[end:end + len(s.observation_ids)] == s.observation_ids
    assert traj.steps[-1].observation_ids == []  # the model never sees the last observation
    if generated:
        row = traj.trl_row()
        assert len(row["logprobs"]) == len(row["completion_ids"]) == len(row["env_mask"])
    else:
        with pytest.raises(CRRError, match="scripted steps"):
            traj.trl_row()


def test_episode_of_the_tiny_model_records_every_step(backend, tokenizer, engine, task):
    config = EpisodeConfig(max_turns=3, max_new_tokens=48, temperature=1.0)
    traj = run_episode(task, backend, engine, tokenizer, config, seed=0)  # this seed plays 3 different tools
    assert traj.infra_error is None and traj.reward in (0.0, 1.0)
    assert traj.end_reason in ("submit", "max_turns") and 2 <= len(traj.steps) <= 3
    check_layout(traj)
    for s in traj.steps:
        assert s.action and s.observation and s.temperature == 1.0 and s.sample_seed is not None
        assert s.entropy >= 0 and s.grammar_rejections >= 0 and s.gen_s > 0 and s.exec_s > 0
        assert (s.call is None) == (s.parse_error is not None)
        if s.call is not None and s.call["name"] != "submit_patch":
            assert s.tool_type in (0.0, 0.25, 0.75, 1.0)
        assert (s.snapshot_ms is None) == (s.call is not None and s.call["name"] == "submit_patch")
    assert traj.steps[0].context_matches  # the backend saw exactly the initial prompt
    # JSON round trip: everything but the runtime handles survives.
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back.to_dict() == traj.to_dict() and back.completion_ids == traj.completion_ids
    old = {**{k: v for k, v in traj.to_dict().items() if k != "sibling"},
           "group": traj.sibling}   # written before the rename
    assert Trajectory.from_dict(old).to_dict() == traj.to_dict()
    assert traj.conversation(tokenizer).token_ids() == traj.prompt_ids + traj.completion_ids
    traj.release()


def test_truncated_calls_are_error_observations_and_the_cap_ends_the_episode(backend, tokenizer, engine, task):
    traj = run_episode(task, backend, engine, tokenizer, EpisodeConfig(max_turns=2, max_new_tokens=3), seed=0)
    assert traj.end_reason == "max_turns" and len(traj.steps) == 2
    for s in traj.steps:
        assert s.truncated and s.is_error and s.call is None and s.tool_type is None
        assert "cut off at 3 tokens" in s.parse_error and s.observation.startswith("Error: ")
        assert len(s.action_ids) == 3
    assert traj.steps[0].observation_ids[0] == tokenizer.eos_token_id  # the environment closes the turn
    assert traj.reward == 0.0 and traj.infra_error is None  # the agent's failure, scored
    check_layout(traj)
    traj.release()


def test_scripted_episode_cap_and_unparsable_calls(tokenizer, engine, task):
    calls = ['{"name": "view_file"', "not json", expert_calls(task)[0], expert_calls(task)[0]]
    grammar = ToolCallGrammar(tokenizer)
    traj = run_episode(task, ScriptedBackend(calls, grammar.tokenize), engine, tokenizer, EpisodeConfig(max_turns=3))
    assert traj.steps[2].action_ids == grammar.tokenize(calls[2])  # the sampler's tokens where the grammar
    assert traj.steps[1].action_ids[-1] == tokenizer.eos_token_id  # accepts the call; else the tokenizer's
    assert [s.is_error for s in traj.steps] == [True, True, False] and traj.end_reason == "max_turns"
    assert "not valid JSON" in traj.steps[1].parse_error and traj.steps[2].tool_type == 0.25
    assert traj.reward == 0.0
    check_layout(traj, generated=False)  # a script's calls carry no generation record
    assert all(s.sample_seed is None and s.gen_s == 0.0 and s.context_matches is None for s in traj.steps)
    traj.release()
    with pytest.raises(CRRError, match="calls ended before its episode did"):
        run_episode(task, ScriptedBackend(calls[2:3]), engine, tokenizer, EpisodeConfig(max_turns=3))
    with pytest.raises(CRRError, match="not a batch of 2"):
        ScriptedBackend(calls).generate([[1], [2]], temperature=0.0, seed=0, max_new_tokens=8)


def test_infrastructure_failures_are_labelled_and_excluded(tokenizer, engine, task, make_task):
    solved = run_episode(task, ScriptedBackend(expert_calls(task)), engine, tokenizer)
    assert solved.reward == 1.0 and solved.end_reason == "submit"

    episode = Episode(task, engine, tokenizer, EpisodeConfig(max_turns=5))
    episode.start()
    episode.act(expert_calls(task)[0])
    episode.sandbox.close()  # the sandbox dies behind the loop's back
    assert episode.act(expert_calls(task)[1]) is None and episode.done
    broken = episode.finish()
    assert broken.reward is None and broken.end_reason == "infra_error" and "closed" in broken.infra_error

    missing = make_task({"a.py": ""}, instance_id="gone", repo_src="/nonexistent/repo")
    unstartable = Episode(missing, engine, tokenizer, EpisodeConfig())
    unstartable.start()
    assert unstartable.done and unstartable.finish().infra_error.startswith("could not start a sandbox")

    summary = summarise([solved, broken], wall_s=1.0, gen_s=0.0)
    assert summary["pass_rate"] == 1.0 and summary["infra_errors"] == 1 and summary["scored"] == 1
    solved.release()
    broken.release()


def test_fork_at_gives_state_s_t_by_restore_and_by_verified_replay(tokenizer, engine, task):
    calls = expert_calls(task)  # run_tests, view, edit, run_tests, submit
    traj = run_episode(task, ScriptedBackend(calls), engine, tokenizer,
                       EpisodeConfig(max_turns=len(calls), digests=True))
    assert traj.reward == 1.0 and set(traj.snapshots) == set(range(len(calls) - 1))
    edit = next(s.t for s in traj.steps if s.call["name"] == "edit_file")
    assert traj.steps[edit].digest != traj.steps[edit + 1].digest  # the edit changed the tree
    for t in (edit, edit + 1):
        with fork_at(traj, t) as sandbox:  # restore of sigma(s_t)
            assert tree_digest(sandbox) == traj.steps[t].digest
            sandbox.write_file("calc.py", b"scribble")  # forks are independent of each other
        with replay_at(traj, t, engine) as sandbox:
            assert tree_digest(sandbox) == traj.steps[t].digest
    # a branch's draft source (crr.policy.drafts): its calls so far, then what its trajectory called from a_t on
    branch = Episode.fork(traj, edit, engine, tokenizer, EpisodeConfig(max_turns=len(calls)))
    ids = [s.action_ids for s in traj.steps]
    assert branch.draft_source() == sum(ids, [])   # a_0 .. a_{t-1}, then the lookahead a_t ..
    branch.act(calls[-1])   # a~_t
    assert branch.draft_source() == sum(ids[:edit], []) + branch.traj.steps[edit].action_ids + sum(ids[edit:], [])
    branch.sandbox.close()
    traj.release()
    assert not traj.snapshots
    with fork_at(traj, edit + 1) as sandbox:  # snapshots gone: verified replay
        assert tree_digest(sandbox) == traj.steps[edit + 1].digest
    traj.steps[edit + 1].digest = "0" * 64
    with pytest.raises(SandboxError, match="diverged"):
        fork_at(traj, edit + 1)
    with pytest.raises(CRRError, match="outside trajectory"):
        fork_at(traj, len(calls))
    no_digests = run_episode(task, ScriptedBackend(calls[:2]), engine, tokenizer,
                             EpisodeConfig(max_turns=2, snapshots=False))
    with pytest.raises(CRRError, match="no snapshot and no recorded tree digest"):
        fork_at(no_digests, 1)


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(CRRError, match="max_turns"):
        EpisodeConfig(max_turns=0)
    with pytest.raises(CRRError, match="max_new_tokens"):
        EpisodeConfig(max_new_tokens=0)

