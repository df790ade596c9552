"""Agent formats (crr.agent.prompt.FORMATS): the paper's and the compact CPU-scale one, same tools and layout."""

from __future__ import annotations

import json

import pytest

from crr.agent.conversation import Conversation, initial_messages, render_text
from crr.agent.episode import EpisodeConfig
from crr.agent.expert import call_json, expert_script
from crr.agent.prompt import FORMATS, agent_format
from crr.errors import CRRError
from crr.eval.evaluate import EvalConfig, Policy
from crr.policy.model import AGENT_FILE, agent_record, default_model_dir, load_policy, write_agent_record
from crr.policy.scripted import ScriptedBackend
from crr.rollout import run_episode
from crr.sandbox import get_engine
from crr.tasks.loaders import load_tasks
from crr.tasks.micro import generate_micro



@pytest.fixture(scope="module")
def tokenizer():
    return load_policy(default_model_dir())[1]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "set"
    generate_micro(out, n=1, seed=0, split="train")
    return load_tasks(str(out))[0]


def test_compact_prompt_is_a_fifth_of_the_papers_and_names_every_tool(tokenizer, task):
    sizes = {}
    for name, fmt in FORMATS.items():
        conv = Conversation(tokenizer, initial_messages(task, "/testbed", 8, name), fmt.tools)
        sizes[name] = len(conv.prompt_ids)
    assert sizes["compact"] * 4 < sizes["paper"], sizes
    text = render_text(tokenizer, initial_messages(task, "/testbed", 8, "compact"), [])
    for tool in ("view_file", "edit_file", "run_shell", "run_tests", "submit_patch"):
        assert tool in text
    assert "at most 8 turns" in text and task.problem_statement.strip() in text
    assert "<tools>" not in text  # no JSON catalogue: the signatures in the system prompt are the catalogue


def test_unknown_format_is_a_clear_error():
    with pytest.raises(CRRError, match="unknown agent format 'terse'"):
        agent_format("terse")
    with pytest.raises(CRRError, match="unknown agent format"):
        EpisodeConfig(agent_format="terse")


def test_compact_episode_bounds_observations_and_rebuilds_its_token_stream(tokenizer, task):
    """The same episode loop and layout: the recorded stream equals the conversation rebuilt from the
    trajectory, and each observation stays inside the format's budget."""
    calls = [call_json(c) for c in expert_script(task)]
    engine = get_engine("local")
    try:
        traj = run_episode(task, ScriptedBackend(calls), engine, tokenizer,
                           EpisodeConfig(max_turns=len(calls), snapshots=False, agent_format="compact"))
    finally:
        engine.close()
    assert traj.reward == 1.0 and traj.agent_format == "compact"
    keep = FORMATS["compact"].obs_keep_chars
    long = [s.observation for s in traj.steps if len(s.observation) > 2 * keep + 60]
    assert not long, [len(o) for o in long]
    assert any("characters elided" in s.observation for s in traj.steps)  # the suite's output was cut
    rebuilt = traj.conversation(tokenizer)
    assert rebuilt.token_ids() == traj.prompt_ids + traj.completion_ids
    assert tokenizer.decode(rebuilt.token_ids()) == render_text(tokenizer, rebuilt.messages, [])


def test_a_model_directory_records_its_format_and_evaluation_uses_it(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    assert agent_record(model) == {}
    write_agent_record(model, "compact", 8)
    assert json.loads((model / AGENT_FILE).read_text()) == {"agent_format": "compact", "max_turns": 8}
    config = EvalConfig.make("nano-test", "nano-test", None, Policy(model=str(model)))
    assert (config.agent_format, config.max_turns) == ("compact", 8)
    told = EvalConfig.make("nano-test", "nano-test", None, Policy(model=str(model)), agent_format="paper",
                           max_turns=20)
    assert (told.agent_format, told.max_turns) == ("paper", 20)
    # an adapter without a record takes its base model's
    adapter = tmp_path / "a"
    adapter.mkdir()
    assert EvalConfig.make("x", "x", None, Policy(model=str(adapter), base_model=str(model))).agent_format == "compact"
