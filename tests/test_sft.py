"""The SFT warm start: expert data rendered through conversation.py, real TRL SFTTrainer steps on the tiny
model, the saved model loading with load_policy, and `crr sft` end to end."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from trl.chat_template_utils import get_training_chat_template
from typer.testing import CliRunner

from crr.agent.conversation import TOOL_CALL_OPEN, render_ids, render_text
from crr.agent.expert import ExpertConfig
from crr.agent.prompt import TOOL_SCHEMAS
from crr.cli import app
from crr.errors import CRRError
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import default_model_dir, load_policy
from crr.sft.rows import action_ids
from crr.sft.trainer import action_token_loss, only_parts
from crr.sft.warm_start import (
    ExpertDataSettings,
    SFTSettings,
    action_field_stats,
    build_sft_dataset,
    install_default,
    sft,
)
from crr.sandbox import get_engine
from crr.rundir import RunDir, append_jsonl, release_locks
from crr.tasks.micro import generate_micro

# Short episodes keep the trainer tests fast; exploration itself is tested in test_expert.py.
LEAN = ExpertConfig(p_list=0.0, p_full_tests=0.0, p_final_suite=0.0, max_decoy_views=1, error_rate=0.5)




def _cut(row: dict, length: int) -> dict:
    """`row` cut to `length` tokens from 8 before its first action: a short row with actions to learn, for the
    tests whose subject is the loss or the trainer's bookkeeping, not a whole conversation (whose long prompt
    would only add seconds)."""
    start = row["assistant_masks"].index(1) - 8
    return {key: row[key][start:start + length] for key in ("input_ids", "assistant_masks")}


@pytest.fixture(scope="module")
def tiny():
    return default_model_dir()  # built on first use into the session's crr cache (conftest)


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "set"
    generate_micro(out, n=2, seed=0, split="train")
    return out


@pytest.fixture(scope="module")
def data(tiny, micro_dir, tmp_path_factory):
    from crr.tasks.loaders import load_tasks

    _, tokenizer = load_policy(tiny)
    run = RunDir.create("sft", "test", root=tmp_path_factory.mktemp("runs"))
    engine = get_engine("local")
    try:
        dataset = build_sft_dataset(load_tasks(str(micro_dir)), engine, seed=0, tokenizer=tokenizer,
                                    settings=ExpertDataSettings(episodes_per_task=1, expert=LEAN, workers=1),
                                    run=run)
    finally:
        engine.close()
    return dataset, tokenizer, run


def test_expert_data_is_deterministic(data, micro_dir):
    """Same tasks, same seed: the same rows token for token (observations hold no host path or timing)."""
    from crr.tasks.loaders import load_tasks

    dataset, tokenizer, _ = data
    engine = get_engine("local")
    try:
        again = build_sft_dataset(load_tasks(str(micro_dir))[:1], engine, seed=0, tokenizer=tokenizer,
                                  settings=ExpertDataSettings(episodes_per_task=1, expert=LEAN, workers=1))
    finally:
        engine.close()
    assert again[0]["input_ids"] == dataset[0]["input_ids"]
    assert again[0]["messages"] == dataset[0]["messages"]


def test_expert_data_resumes_with_the_episodes_played(data, micro_dir, tmp_path):
    """An interrupted `crr sft` keeps its finished episodes: built again in (a copy of) the run that played them,
    nothing is played twice and the rows come back whole; an episode whose row was lost (an interrupt between
    the row and its record) is played again. `progress` gets the kept episodes' records first (the bar of
    `crr sft --resume` starts from them), then the new one's."""
    from crr.tasks.loaders import load_tasks

    dataset, tokenizer, run = data
    shutil.copytree(run.path, tmp_path / "run")
    copy = RunDir.open(tmp_path / "run", write=True)
    rows_file = copy.path / "expert_rows.jsonl"
    lines = rows_file.read_text().splitlines(keepends=True)
    assert len(lines) == len(dataset) >= 1
    rows_file.write_text("".join(lines[:-1]))
    lost = json.loads(lines[-1])
    records = copy.records("expert.jsonl")
    played, engine = [], get_engine("local")
    try:
        resumed = build_sft_dataset(load_tasks(str(micro_dir)), engine, seed=0, tokenizer=tokenizer,
                                    settings=ExpertDataSettings(episodes_per_task=1, expert=LEAN, workers=1),
                                    run=copy, progress=played.append)
    finally:
        engine.close()
    assert resumed["input_ids"] == dataset["input_ids"]
    assert len(copy.records("expert.jsonl")) == len(records) + 1   # only the lost one played again
    assert played[:-1] == [r for r in records if (r["instance_id"], r["seed"]) != (lost["instance_id"], lost["seed"])]
    assert (played[-1]["instance_id"], played[-1]["seed"]) == (lost["instance_id"], lost["seed"])


def _masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_expert_data_is_the_conversation_token_stream(data):
    dataset, tokenizer, run = data
    assert len(dataset) == 2
    summary = json.loads((run.path / "expert_summary.json").read_text())
    assert summary["kept"] == summary["episodes"] == 2 and summary["kept_fraction"] == 1.0
    assert [r["kept"] for r in run.records("expert.jsonl")] == [True, True]
    grammar = ToolCallGrammar(tokenizer)
    for row in dataset:
        ids, mask, messages = row["input_ids"], row["assistant_masks"], row["messages"]
        # The row is the chat template's rendering of its messages (as text: actions are the sampler's ids).
        assert tokenizer.decode(ids) == render_text(tokenizer, messages)
        assert ids[:len(render_ids(tokenizer, messages[:2]))] == render_ids(tokenizer, messages[:2])
        # The mask covers exactly the actions: one masked run per assistant message, each the call the
        # grammar-constrained sampler emits for it (no grammar rejection anywhere) plus the end-of-turn.
        runs = _masked_runs(ids, mask)
        actions = [m for m in messages if m["role"] == "assistant"]
        assert len(runs) == len(actions) > 3
        for run_ids, message in zip(runs, actions):
            fn = message["tool_calls"][0]["function"]
            call = f'{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}'
            assert run_ids == action_ids(grammar, call)
            assert tokenizer.decode(run_ids) == f"{TOOL_CALL_OPEN}{call}\n</tool_call>{tokenizer.eos_token}"
            matcher = grammar.matcher()
            for token in run_ids[:-1]:
                assert matcher.allowed()[token]
                matcher.advance(token)
            assert matcher.allowed()[tokenizer.eos_token_id]
        assert mask[-1] == 1  # ends with the submit action; its observation is never shown
        assert json.loads(row["tools"]) == TOOL_SCHEMAS


def test_action_ids_follow_the_tokenizer_except_where_the_grammar_forces(data):
    _, tokenizer, _ = data
    grammar = ToolCallGrammar(tokenizer)
    view = '{"name": "view_file", "arguments": {"path": "pkg/stats.py", "start": 16}}'
    encoded = tokenizer.encode(f"{TOOL_CALL_OPEN}{view}\n</tool_call>", add_special_tokens=False)
    assert action_ids(grammar, view) == encoded + [tokenizer.eos_token_id]
    shell = '{"name": "run_shell", "arguments": {"command": "git ls-files"}}'
    ids = action_ids(grammar, shell)
    assert tokenizer.decode(ids[:-1]) == f"{TOOL_CALL_OPEN}{shell}\n</tool_call>"
    pieces = [tokenizer.decode([i]) for i in ids]
    # run_shell and run_tests part after "run_": the grammar forces "_" there, where BPE would say "_shell"
    assert "_" in pieces and "_shell" not in pieces
    assert "_shell" in [tokenizer.decode([i]) for i in tokenizer.encode(shell, add_special_tokens=False)]
    with pytest.raises(CRRError, match="does not accept"):
        action_ids(grammar, '{"name": "rm_rf", "arguments": {}}')


def test_trl_assistant_only_rendering_agrees(data):
    """TRL's own assistant-only rendering (its {% generation %} training template) of the same messages is
    the same text with the same spans trained, except that TRL also trains the newline after each
    end-of-turn, which the policy never emits (generation stops at <|im_end|>)."""
    dataset, tokenizer, _ = data
    template = get_training_chat_template(tokenizer)
    row = dataset[0]
    messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
    out = tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, chat_template=template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    theirs = [tokenizer.decode(r) for r in _masked_runs(out["input_ids"], out["assistant_masks"])]
    ours = [tokenizer.decode(r) for r in _masked_runs(row["input_ids"], row["assistant_masks"])]
    assert theirs == [text + "\n" for text in ours]
    assert tokenizer.decode(out["input_ids"]).startswith(tokenizer.decode(row["input_ids"]))


def _action_loss(model, dataset) -> float:
    """Mean next-token loss on the masked (action) tokens of every row."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in dataset:
            ids = torch.tensor([row["input_ids"]])
            labels = ids.clone()
            labels[torch.tensor([row["assistant_masks"]]) == 0] = -100
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            count += n
    return total / count


def test_sft_trains_on_actions_saves_and_is_deterministic(data, tiny, tmp_path):
    full, _, _ = data
    dataset = full.select([min(range(len(full)), key=lambda i: len(full[i]["input_ids"]))])  # the shorter row
    settings = SFTSettings(epochs=3, learning_rate=2e-3, warmup_ratio=0.0, grad_accum=1)
    logs = []
    out = sft(tiny, dataset, tmp_path / "a", settings, on_log=logs.append)
    base, _ = load_policy(tiny)
    trained, tokenizer = load_policy(out)  # the saved directory loads like any policy
    assert tokenizer.chat_template and tokenizer.padding_side == "left"
    assert json.loads((out / "crr_sft.json").read_text())["rows"] == 1
    assert _action_loss(trained, dataset) < _action_loss(base, dataset) - 0.3
    base_weights = base.state_dict()
    changed = [name for name, p in trained.state_dict().items() if not torch.equal(p, base_weights[name])]
    assert len(changed) > len(base.state_dict()) // 2
    losses = [r["loss"] for r in logs if "loss" in r]
    assert len(losses) == 3 * len(dataset) // settings.grad_accum  # every optimizer step logged
    # The probe sees the same: the trained model is closer to the expert on every part of its calls.
    before, after = action_field_stats(base, tokenizer, dataset), action_field_stats(trained, tokenizer, dataset)
    assert {"tool", "path"} <= set(after) and set(after) == set(before)
    assert all(after[part]["nll"] < before[part]["nll"] for part in after)
    assert sum(r["tokens"] for r in after.values()) < sum(dataset[0]["assistant_masks"])  # structure left out
    # Same data, same seed: the same weights.
    again, _ = load_policy(sft(tiny, dataset, tmp_path / "b", settings))
    assert all(torch.equal(p, again.state_dict()[name]) for name, p in trained.state_dict().items())


def test_a_resumed_sft_counts_its_tokens_on_from_the_checkpoint(data, tiny, tmp_path):
    """TRL counts trained tokens (num_tokens) in memory only; a run interrupted after its first epoch's checkpoint
    and resumed logs the same counts as one that was not."""
    rows, _, _ = data
    full = datasets.Dataset.from_list([_cut(row, 128) for row in rows])
    settings = SFTSettings(epochs=2, warmup_ratio=0.0, grad_accum=1, batch_size=1, logging_steps=1)
    whole = []
    sft(tiny, full, tmp_path / "whole", settings, on_log=whole.append)

    def stop_in_the_second_epoch(step, total):
        if step > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sft(tiny, full, tmp_path / "cut", settings, checkpoints=tmp_path / "ckpt", progress=stop_in_the_second_epoch)
    resumed = []
    sft(tiny, full, tmp_path / "cut", settings, checkpoints=tmp_path / "ckpt", resume=True, on_log=resumed.append)
    counts = {r["step"]: r["num_tokens"] for r in whole if "num_tokens" in r}
    again = {r["step"]: r["num_tokens"] for r in resumed if "num_tokens" in r}
    assert again and min(again) > 1 and again == {k: counts[k] for k in again}, (counts, again)


def test_group_by_length_batches_rows_of_about_one_length(data, tiny, tmp_path, monkeypatch):
    """group_by_length hands the trainer batches of rows of about one length (transformers'
    LengthGroupedSampler: sorted by length within shuffled megabatches, here of 8 rows), so batches pad less
    than random ones: 32 rows of two lengths in batches of two, at most one mixed batch per megabatch, fewer
    than random batches of the same rows and seed mix. It refuses to keep rows in order."""
    import crr.sft.trainer as trainer

    full, _, _ = data
    rows = datasets.Dataset.from_list([_cut(full[0], n) for n in [16, 168] * 16])
    real, seen = trainer.action_nll, []

    def spy(model, inputs):
        seen.append(len(set(inputs["attention_mask"].sum(1).tolist())) > 1)  # a batch of two lengths
        return real(model, inputs)

    monkeypatch.setattr(trainer, "action_nll", spy)
    mixed = {}
    for grouped in (True, False):
        seen.clear()
        sft(tiny, rows, tmp_path / str(grouped), SFTSettings(epochs=1, batch_size=2, group_by_length=grouped))
        mixed[grouped] = sum(seen)
        assert len(seen) == 16
    assert mixed[True] <= 4 < mixed[False]
    with pytest.raises(CRRError, match="group_by_length"):
        SFTSettings(group_by_length=True, shuffle=False)


def test_action_token_loss_is_the_models_own_loss_and_gradient(data, tiny):
    """The trainer's loss (the LM head on the action positions alone) equals the model's own mean NLL over the
    labelled tokens, gradient included, on a right-padded batch of two rows of different lengths."""
    from collections import defaultdict
    from types import SimpleNamespace

    dataset, _, _ = data
    rows = [_cut(dataset[i], length) for i, length in ((0, 96), (1, 160))]
    width = max(len(r["input_ids"]) for r in rows)
    assert len({len(r["input_ids"]) for r in rows}) == 2  # the padding is exercised
    pad = lambda values, fill: torch.tensor([v + [fill] * (width - len(v)) for v in values])
    ids = [r["input_ids"] for r in rows]
    labels = [[t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"])] for r in rows]
    inputs = {"input_ids": pad(ids, 0), "attention_mask": pad([[1] * len(v) for v in ids], 0),
              "labels": pad(labels, -100)}
    model, _ = load_policy(tiny)
    model.float().train()
    trainer = SimpleNamespace(_metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0)
    ours = action_token_loss(trainer, model, dict(inputs))
    ours.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    theirs = model(**inputs).loss
    theirs.backward()
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in model.named_parameters())
    assert trainer._total_train_tokens == sum(len(v) for v in ids)
    assert 0.0 <= trainer._metrics["train"]["mean_token_accuracy"][0] <= 1.0
    # a batch weighted by the trainer's token count (gradient accumulation) divides by it instead
    half = action_token_loss(trainer, model, dict(inputs),
                             num_items_in_batch=2 * sum(map(sum, (r["assistant_masks"] for r in rows))))
    assert torch.allclose(half, theirs / 2, atol=1e-5)


def test_loss_on_keeps_the_mask_on_those_parts_only(data, tiny, tmp_path):
    dataset, tokenizer, _ = data
    grammar = ToolCallGrammar(tokenizer)
    masked = only_parts(dataset, grammar, ["replacement"])
    for row, kept in zip(dataset, masked):
        runs = [tokenizer.decode(run) for run in _masked_runs(row["input_ids"], kept["assistant_masks"])]
        calls = [json.loads(c) for c in re.findall(r'<tool_call>\n(\{"name": ".*?)\n</tool_call>',
                                                   tokenizer.decode(row["input_ids"]), re.DOTALL)]
        replacements = [c["arguments"]["replacement"] for c in calls if c["name"] == "edit_file"]
        # each run: the value as the call writes it, then the token that closes it (the sampler's choice)
        assert replacements and len(runs) == len(replacements)
        for run, value in zip(runs, replacements):
            assert (run.startswith(json.dumps(value)[1:-1])
                    and re.fullmatch(r'"[}\s]*', run[len(json.dumps(value)) - 2:]))
    # trained on the replacements only, their loss falls
    row = dataset.select([0])
    out = sft(tiny, dataset.select([0]), tmp_path / "r", SFTSettings(epochs=3, learning_rate=2e-3, warmup_ratio=0.0,
                                                                   loss_on=["replacement"]))
    before, after = (action_field_stats(load_policy(m)[0], tokenizer, row) for m in (tiny, out))
    assert after["replacement"]["nll"] < before["replacement"]["nll"] - 0.3
    with pytest.raises(CRRError, match="loss_on"):
        SFTSettings(loss_on=["replacment"])


def test_sft_rejects_bad_input(data, tiny, tmp_path):
    dataset, _, _ = data
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CRRError, match="not an empty directory"):
        sft(tiny, dataset, tmp_path / "full")
    with pytest.raises(CRRError, match="lacks"):
        sft(tiny, dataset.remove_columns("assistant_masks"), tmp_path / "m")
    with pytest.raises(CRRError, match="max_length"):
        sft(tiny, dataset, tmp_path / "m", SFTSettings(max_length=64))
    with pytest.raises(CRRError, match="epochs"):
        SFTSettings(epochs=0)


def test_install_default_copies_once(tiny, tmp_path):
    target = install_default(tiny, tmp_path / "cache" / "sft")
    assert (target / "config.json").is_file()
    (target / "marker").write_text("first")
    install_default(tiny, target)  # an existing default is kept
    assert (target / "marker").read_text() == "first"


def test_sft_command_end_to_end_and_resume(tiny, micro_dir, tmp_path):
    runner = CliRunner()
    args = ["sft", "--tasks", str(micro_dir), "--n-tasks", "2", "--episodes", "1", "--epochs", "1",
            "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "kept 2/2" in result.output and "(step 2), 2 logged steps" in result.output
    (run_dir,) = tmp_path.iterdir()
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "manifest.json", "expert.jsonl", "expert_summary.json", "metrics.jsonl", "model",
            "expert_data", "checkpoints"} <= names
    run = RunDir.open(run_dir)
    assert run.config["recipe"]["train"]["epochs"] == 1.0 and run.config["model"] == str(tiny)
    assert [r["event"] for r in run.records("metrics.jsonl")].count("sft") >= 1
    model, _ = load_policy(run_dir / "model")
    # Resume after losing the final model: the saved expert data and checkpoint are reused, nothing re-run.
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    shutil.rmtree(run_dir / "model")
    logged = run.records("metrics.jsonl")
    append_jsonl(run_dir / "metrics.jsonl",
                 {"event": "sft", "stage": 0, "step": 3, "loss": 9.0})   # after the checkpoint
    result = runner.invoke(app, ["sft", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert len(run.records("expert.jsonl")) == 2
    # each step is recorded once, the closing record once: what the checkpoint did not hold was redone, not added
    relogged = run.records("metrics.jsonl")
    assert [r.get("step") for r in relogged] == [r.get("step") for r in logged], (logged, relogged)
    assert sum("train_runtime" in r for r in relogged) == 1
    resumed, _ = load_policy(run_dir / "model")
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in weights.items())


def test_cli_defaults_are_the_default_recipe():
    from crr.cli import _SFT_DEFAULTS
    from crr.sft.warm_start import SFTRecipe

    recipe = SFTRecipe()
    assert _SFT_DEFAULTS == {"tasks": recipe.tasks, "n_tasks": recipe.n_tasks,
                             "episodes": recipe.data.episodes_per_task, "error_rate": recipe.data.expert.error_rate,
                             "epochs": recipe.train.epochs, "lr": recipe.train.learning_rate,
                             "bf16": recipe.train.bf16, "decoy_views": recipe.data.expert.max_decoy_views}


def test_model_probe_command(tiny, micro_dir):
    result = CliRunner().invoke(app, ["model", "probe", "--model", str(tiny), "--tasks", str(micro_dir),
                                      "--n-tasks", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["episodes"] == 1 and {"tool", "path", "replacement"} <= set(out["parts"])
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["tokens"] > 0 for r in out["parts"].values())
    result = CliRunner().invoke(app, ["model", "probe", "--n-tasks", "0"])
    assert result.exit_code == 2 and "at least 1" in result.output
    result = CliRunner().invoke(app, ["model", "probe", "--error-rate", "1.5"])
    assert result.exit_code == 2 and "error_rate must be between 0 and 1" in result.output


def test_model_sft_bench_command(tiny):
    """Both losses timed on the same batches, and the action-token loss on the same rows batched by length; the
    figures are positive, the ratios are theirs, and grouping by length pads no more than random batches. In fp32
    (--fp32): a CPU without AVX512-BF16 emulates the bf16 autocast the command defaults to, which a one-row,
    one-step bench runs."""
    result = CliRunner().invoke(app, ["model", "sft-bench", "--model", str(tiny), "--batch", "2", "--steps", "2",
                                      "--level", "0", "--fp32", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["tokens"] > out["action_tokens"] > 0
    assert out["speedup"] == pytest.approx(out["action_tokens_tokens_per_s"] / out["trl_fused_head_tokens_per_s"])
    assert out["grouped_speedup"] == pytest.approx(out["grouped_tokens_per_s"] / out["action_tokens_tokens_per_s"])
    assert 1.0 <= out["grouped_padded_per_token"] <= out["random_padded_per_token"]
    result = CliRunner().invoke(app, ["model", "sft-bench", "--model", str(tiny), "--batch", "1", "--steps", "1",
                                      "--level", "0", "--bf16"])
    assert result.exit_code == 0 and "bf16" in result.stdout, result.output
    result = CliRunner().invoke(app, ["model", "sft-bench", "--level", "5"])
    assert result.exit_code == 2 and "--level one of (0, 1, 2, 3, 4)" in result.output


def test_model_probe_direct_expert(tiny, micro_dir, monkeypatch):
    """--error-rate 0 --decoy-views 0: the probed episodes carry no wrong edit and view no decoy file."""
    from crr.sft import warm_start as sft

    configs, plans = [], []
    explore = sft.explore_script

    def recorded(task, sandbox, seed, config):
        configs.append(config)
        plans.append(explore(task, sandbox, seed, config))
        return plans[-1]

    monkeypatch.setattr(sft, "explore_script", recorded)
    result = CliRunner().invoke(app, ["model", "probe", "--model", str(tiny), "--tasks", str(micro_dir),
                                      "--n-tasks", "2", "--error-rate", "0", "--decoy-views", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["error_rate"] == 0.0
    assert [(c.error_rate, c.max_decoy_views) for c in configs] == [(0.0, 0)] * 2
    assert all(p.wrong_edit is None for p in plans)


def test_sft_command_bad_input(tmp_path):
    result = CliRunner().invoke(app, ["sft", "--n-tasks", "0", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "n_tasks must be at least 1" in result.output


def test_sft_resume_of_another_commands_run_is_one_line(tmp_path):
    """`crr sft --resume` on a train or eval run (or an sft run without its model and recipe): one line naming
    what it is, with nothing written there or made (was: KeyError 'recipe')."""
    out = tmp_path / "out"
    for command, config in (("train", {"model": None, "tasks": "nano-train"}), ("eval", {"model": None}),
                            ("sft", {"model": "m"})):
        run = RunDir.create(command, root=tmp_path / command, config=config)
        release_locks()
        before = {p: p.stat().st_mtime_ns for p in run.path.iterdir()}
        result = CliRunner().invoke(app, ["sft", "--resume", str(run.path), "--out", str(out)])
        release_locks()
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert lines[0] == (f"error: {run.path} is a `crr {command}` run, not a warm start; --resume takes a directory "
                            "made by crr sft" if command != "sft" else
                            f"error: {run.path / 'config.yaml'} is corrupt (not a warm start's config: no model and "
                            "recipe)"), lines[0]
        assert {p: p.stat().st_mtime_ns for p in run.path.iterdir()} == before
    assert not out.exists()


def _small_recipe_run(name: str, tmp_path: Path, model: Path | None = None) -> tuple[dict, Path]:
    """experiments/NAME at a small budget (4 nano tasks, 8 curriculum rows, 2 epochs a stage), through
    `crr sft`; the recipe and the run directory. The loss falls."""
    import yaml

    recipe = yaml.safe_load((Path(__file__).parent.parent / "experiments" / name).read_text())
    tasks = tmp_path / "nano"
    generate_micro(tasks, n=4, seed=0, split="train", tier="nano")
    recipe.update(tasks=str(tasks), n_tasks=4, curriculum_rows=8)
    recipe["train"].update(batch_size=2, logging_steps=1, bf16=False)
    for stage in recipe["stages"]:
        stage["epochs"] = 2
    small = tmp_path / "recipe.yaml"
    small.write_text(yaml.safe_dump(recipe))
    args = ["sft", "--recipe", str(small), "--out", str(tmp_path / "runs")] + (["--model", str(model)] if model else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    losses = [r["loss"] for r in RunDir.open(run_dir).records("metrics.jsonl") if "loss" in r]
    assert len(losses) >= 2 * len(recipe["stages"]) + 2 and sum(losses[-2:]) < sum(losses[:2])
    return recipe, run_dir


def test_the_e4_recipe_runs_end_to_end_on_a_small_budget(tiny, tmp_path):
    """experiments/sft-nano.yaml (the recipe of e4, the re-split default's base model) at a small budget:
    nano tasks, compact format, expert data in real sandboxes, SFT (its stages: curriculum in order, then
    shuffled, then both); the loss falls and the model records the format it was trained with."""
    from crr.policy.model import agent_record

    recipe, run_dir = _small_recipe_run("sft-nano.yaml", tmp_path)
    assert [p.name for p in sorted(run_dir.glob("stage-*"))] == [f"stage-{i}" for i in range(1, len(recipe["stages"]))]
    assert agent_record(run_dir / "model") == {"agent_format": "compact", "max_turns": recipe["data"]["max_turns"]}
    rows = json.loads((run_dir / "expert_summary.json").read_text())
    assert rows["kept"] >= 3 and rows["mean_tokens"] < 2048
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: nano-train\nstages: [{data: everything}]\n")
    result = CliRunner().invoke(app, ["sft", "--recipe", str(bad)])
    assert result.exit_code == 2 and "bad SFT recipe" in result.output


def test_the_split_recipe_retokenizes_before_the_data(tiny, tmp_path):
    """experiments/sft-nano-split.yaml at a small budget: the run's base_model/ is the model with its tokenizer
    re-split (crr.policy.model.split_word_spaces), the data is tokenized with it and the trained model keeps it."""
    from transformers import AutoTokenizer

    from crr.policy.model import split_word_spaces

    _, run_dir = _small_recipe_run("sft-nano-split.yaml", tmp_path, model=tiny)
    original = json.loads((tiny / "tokenizer.json").read_text())
    assert json.loads((run_dir / "base_model" / "tokenizer.json").read_text()) == split_word_spaces(original)
    trained = AutoTokenizer.from_pretrained(run_dir / "model")
    assert [trained.decode([i]) for i in trained.encode("x = niljos", add_special_tokens=False)][2] == " "
    split = AutoTokenizer.from_pretrained(run_dir / "base_model")
    rows = datasets.load_from_disk(str(run_dir / "curriculum_data"))
    text = split.decode(rows[0]["input_ids"])
    assert split.encode(text, add_special_tokens=False) == rows[0]["input_ids"]


def test_the_two_hour_recipe_starts_from_random_weights_with_the_levels_in_order(tmp_path):
    """experiments/sft-nano-2h.yaml (the shipped default's recipe) at a small budget, from the random tiny model
    (no --model): the tokenizer re-split, curriculum rows of levels 0, 1 and 2 in that order, then the expert
    stage; a bad level exits 2."""
    _, run_dir = _small_recipe_run("sft-nano-2h.yaml", tmp_path)
    levels = datasets.load_from_disk(str(run_dir / "curriculum_data"))["level"]
    assert levels == sorted(levels) and set(levels) == {0, 1, 2}
    assert (run_dir / "base_model" / "tokenizer.json").is_file() and (run_dir / "stage-1" / "config.json").is_file()
    bad = tmp_path / "bad.yaml"
    bad.write_text("tasks: nano-train\ncurriculum_rows: 4\ncurriculum_levels: [5]\n")
    result = CliRunner().invoke(app, ["sft", "--recipe", str(bad)])
    assert result.exit_code == 2 and "curriculum_levels are some of 0, 1, 2, 3" in result.output


def test_the_multi_recipe_grows_the_shipped_default_into_the_multi_tier(tmp_path):
    """experiments/sft-multi-2h.yaml (the multi tier's one warm-start recipe: the expert's multi episodes with
    level-3 locate rows, then level-4 whole episodes alone) at a small budget, from the shipped default: the expert
    plays 2 multi tasks at H = 12 in real sandboxes, 1 locate row and 4 whole rows are drawn, each stage trains
    two epochs on its levels' rows (so the loss falls) with fp32 master weights although the shipped default is
    bf16 (pure bf16 training rounds updates away), and the model records the multi turn cap."""
    import yaml

    from crr.policy.model import SHIPPED_DEFAULT, agent_record

    recipe = yaml.safe_load((Path(__file__).parent.parent / "experiments" / "sft-multi-2h.yaml").read_text())
    assert recipe["curriculum_levels"] == [3, 4, 4, 4, 4] and recipe["train"]["group_by_length"]
    assert [(s["data"], s["levels"]) for s in recipe["stages"]] == [("both", [3]), ("curriculum", [4])]
    assert (recipe["data"]["expert"]["p_grep_named"] == 1.0 and recipe["data"]["max_turns"] == 12
            and recipe["train"]["max_length"] >= recipe["data"]["max_tokens"])
    tasks = tmp_path / "multi"
    generate_micro(tasks, n=2, seed=0, split="train", tier="multi")
    recipe.update(tasks=str(tasks), n_tasks=2, curriculum_rows=5)
    recipe["data"]["episodes_per_task"] = 1
    recipe["train"].update(batch_size=2, logging_steps=1, warmup_ratio=0.0)
    for stage in recipe["stages"]:
        stage["epochs"] = 2
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["sft", "--recipe", str(tmp_path / "recipe.yaml"), "--model", str(SHIPPED_DEFAULT),
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "expert_summary.json").read_text())["kept"] == 2
    assert datasets.load_from_disk(str(run_dir / "curriculum_data"))["level"] == [3, 4, 4, 4, 4]
    assert sorted(p.name for p in run_dir.glob("stage-*")) == ["stage-1"]
    assert [json.loads((run_dir / d / "crr_sft.json").read_text())["rows"] for d in ("stage-1", "model")] == [3, 4]
    assert agent_record(run_dir / "model") == {"agent_format": "compact", "max_turns": 12}
    losses = [r["loss"] for r in RunDir.open(run_dir).records("metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 + 4 and sum(losses[6:]) < sum(losses[4:6])  # 3 rows, then 4, in batches of 2, 2 epochs each
    assert json.loads((SHIPPED_DEFAULT / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((run_dir / "model" / "config.json").read_text())["dtype"] == "float32"
    recipe["stages"][1]["levels"] = [2]  # not drawn
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["sft", "--recipe", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2 and "a stage's levels are some of curriculum_levels" in result.output
