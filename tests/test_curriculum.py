"""The synthetic lookup-and-repair curriculum: its rows are repairs that work, in an episode's token layout."""

from __future__ import annotations

import json
import random
import re

import pytest

from crr.agent.conversation import Conversation, render_text
from crr.agent.tools import split_lines
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import default_model_dir, load_policy
from crr.sft.curriculum import curriculum_rows, repair_messages
from crr.tasks.nano import run_call



def _draws(level: int, n: int, def_edit: bool = False) -> list[list[dict]]:
    rng, out = random.Random(level), []
    while len(out) < n:
        messages = repair_messages(rng, level, 8, def_edit)
        if messages is not None:
            out.append(messages)
    return out


@pytest.mark.parametrize("level,def_edit", [(1, False), (2, False), (2, True)])
def test_each_row_is_a_repair_that_makes_the_issue_call_right(level, def_edit):
    for messages in _draws(level, 20, def_edit):
        view, edit = (json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in messages[2:5:2])
        listing = messages[3]["content"]
        lines = [re.sub(r"^\s*\d+\t", "", line) + "\n" for line in listing.splitlines()[1:]]
        assert edit["path"] == view["path"]
        if def_edit:  # from the def line of the function the issue names down to the fixed line
            assert edit["start"] < edit["end"] and lines[edit["start"] - 1].startswith("def ")
            assert edit["replacement"].startswith(lines[edit["start"] - 1])
        else:
            assert edit["start"] == edit["end"]
        fixed = lines[:edit["start"] - 1] + split_lines(edit["replacement"]) + lines[edit["end"]:]
        call = re.search(r"`[\w.]+\.(\w+)\((.*)\)` (returns|raises) `(.*)`\. I expected `(.*)`\.",
                         messages[1]["content"])
        function, args, _, observed, expected = call.groups()
        assert run_call("".join(lines), function, args) != run_call("".join(fixed), function, args)
        assert run_call("".join(fixed), function, args) == f"returns {expected}"
        if level == 1:
            assert listing.count("def ") == 2


def test_level_0_views_only_the_function_the_issue_names():
    for messages in _draws(0, 20):
        view, edit = (json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in messages[2:5:2])
        listing = messages[3]["content"].splitlines()
        shown = {int(n): text for n, text in (line.split("\t", 1) for line in listing[1:] if "\t" in line)}
        function = re.search(r"`[\w.]+\.(\w+)\(", messages[1]["content"]).group(1)
        assert listing[0].startswith(f"{view['path']}: lines {view['start']}-{view['end']} of ")
        assert sorted(shown) == list(range(view["start"], view["end"] + 1))
        assert shown[view["start"]].startswith(f"def {function}(") and "def " not in "".join(list(shown.values())[1:])
        assert view["start"] < edit["start"] == edit["end"] <= view["end"] and edit["path"] == view["path"]
        assert shown[edit["start"]] != edit["replacement"].removesuffix("\n")


def test_rows_have_the_compact_episode_layout():
    tokenizer = load_policy(default_model_dir())[1]
    rows = curriculum_rows(ToolCallGrammar(tokenizer), 6, seed=0)
    assert [r["level"] for r in rows] == [1, 1, 1, 2, 2, 2]
    messages = _draws(1, 1)[0]
    conv = Conversation(tokenizer, messages[:2], [])
    assert tokenizer.decode(rows[0]["input_ids"][:len(conv.prompt_ids)]).startswith("<|im_start|>system\nFix the issue")
    assert all(len(r["input_ids"]) == len(r["assistant_masks"]) < 1200 for r in rows)
    assert all(0 < sum(r["assistant_masks"]) < len(r["input_ids"]) for r in rows)
    text = render_text(tokenizer, messages, [])
    assert "<tools>" not in text and text.count("<tool_call>") == 3


def test_the_name_copy_probe_counts_names_not_escapes_and_splits_name_starts_by_context():
    """research/name_copy_probe.py (issue 11's copy diagnostics): the `n` of a JSON-escaped newline is not a name
    start, attributes and builtins are not names; on curriculum rows every name start lands in exactly one bucket
    of its previous token's followers and in one of space-led or not, and the embedding figure is a cosine."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "research" / "name_copy_probe.py"
    spec = importlib.util.spec_from_file_location("name_copy_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    text = "    return kur.upper() + min(ja, bo)\\n"
    starts = [text[c:c + 3] for c, label in enumerate(probe.name_labels(text)) if label == "name start"]
    assert starts == ["kur", "ja,", "bo)"]
    model, tokenizer = load_policy(default_model_dir())
    grammar = ToolCallGrammar(tokenizer)
    out = probe.probe_model(model, grammar, curriculum_rows(grammar, 4, seed=999, levels=(2,)))
    buckets = [v["tokens"] for k, v in out.items() if k.startswith("name start, previous token")]
    assert out["name start"]["tokens"] > 0 and sum(buckets) == out["name start"]["tokens"]
    spaces = [out.get(f"name start, {k}", {"tokens": 0})["tokens"] for k in ("space-led token",
                                                                          "token without a leading space")]
    assert sum(spaces) == out["name start"]["tokens"] and spaces[0] > 0
    assert all(-1 <= c <= 1 for c in out["mean pairwise cosine of the input embeddings"].values())


def test_locate_rows_are_multi_episodes_whose_greps_copy_a_failing_function_and_view_its_hit():
    """Level 3 (crr.sft.locate): real pytest and grep output on a generated multi package; every grep names a
    function whose visible test the run shows failing, in the issue's order, and the next call views the file
    its hit names (from the hit's line when focused); deterministic in the seed."""
    from crr.sft.locate import locate_calls, locate_conversations

    rng, draws = random.Random(3), []
    while len(draws) < 6:
        drawn = locate_calls(rng)
        if drawn is not None:
            draws.append(drawn)
    for issue, calls in draws:
        assert calls[0][0].name == "run_tests" and calls[-1][1] is None and calls[-1][0].name == "view_file"
        failed = re.findall(r"^FAILED tests/test_\w+\.py::test_(\w+)_\d+ ", calls[0][1], re.M)
        assert failed and calls[0][1].endswith("[exit code: 1]")
        greps = [c for c, _ in calls if c.name == "run_shell"]
        names = [re.fullmatch(r"grep -rn 'def (\w+)\(' \w+", g.arguments["command"])[1] for g in greps]
        assert set(names) <= set(failed) and len(set(names)) == len(names)
        positions = [issue.find(f"test_{n}_") if issue.startswith("Failing tests") else issue.find(f"{n}(")
                     for n in names]
        assert -1 not in positions and positions == sorted(positions)
        for (call, obs), (nxt, _) in zip(calls, calls[1:]):
            if call.name == "run_shell":
                path, line, text = obs.splitlines()[0].split(":", 2)
                assert text.startswith(f"def {names[greps.index(call)]}(") and nxt.name == "view_file"
                assert nxt.arguments["path"] == path and nxt.arguments.get("start", int(line)) == int(line)
            if call.name == "edit_file":
                assert obs.startswith(f"--- a/{call.arguments['path']}")
    a = locate_conversations(random.Random(9), 3, 12)
    assert a == locate_conversations(random.Random(9), 3, 12) and len(a) == 3


def test_multi_repair_rows_fix_every_failing_function_then_submit():
    """Level 4 (crr.sft.locate, whole): the locate episode goes on through every bug: each failing function is
    grepped, its module viewed and edited (one changed line, the diff the edit's observation), then submit."""
    from crr.sft.locate import locate_calls

    rng, draws = random.Random(4), []
    while len(draws) < 6:
        drawn = locate_calls(rng, whole=True)
        if drawn is not None:
            draws.append(drawn)
    for _issue, calls in draws:
        assert calls[-1][1] is None and calls[-1][0].name == "submit_patch"
        failed = set(re.findall(r"^FAILED tests/test_\w+\.py::test_(\w+)_\d+ ", calls[0][1], re.M))
        assert failed
        names = [re.fullmatch(r"grep -rn 'def (\w+)\(' \w+", c.arguments["command"])[1]
                 for c, _ in calls if c.name == "run_shell"]
        assert set(names) == failed and len(names) == len(failed)
        steps = [c.name for c, _ in calls[1:-1]]
        assert steps == ["run_shell", "view_file", "edit_file"] * len(names)
        for (call, obs) in calls:
            if call.name == "edit_file":
                minus = [ln for ln in obs.splitlines() if ln.startswith("-") and not ln.startswith("---")]
                plus = [ln for ln in obs.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
                assert len(minus) == len(plus) == 1 and plus[0][1:] == call.arguments["replacement"].rstrip("\n")
