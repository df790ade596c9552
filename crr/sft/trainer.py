"""The training half of the warm start: TRL's SFTTrainer on token rows (`input_ids`, `assistant_masks`).

Kept apart from crr.sft.warm_start (expert data: sandboxes, tools, the grammar) so the training step imports
only torch, transformers, TRL and datasets and runs on its own, for instance on a GPU node with the expert
data built elsewhere:

    python -m crr.sft.trainer MODEL_DIR OUT_DIR EXPERT_DATA_DIR... [--settings JSON] [--agent compact:8]

(`crr sft` runs it in-process; both give the same model for the same rows and settings on one device.)
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from crr.agent.prompt import TOOL_SCHEMAS
from crr.errors import CRRError
from crr.policy.grammar import ToolCallGrammar
from crr.policy.model import load_policy, quiet_hf, write_agent_record
from crr.sandbox.checkout import building
from crr.sft.rows import action_parts

log = logging.getLogger(__name__)


@dataclass
class SFTSettings:
    """Every hyperparameter of the warm start (defaults: CPU, the tiny model, a few minutes per epoch)."""
    epochs: float = 2.0
    learning_rate: float = 1e-3          # a few-million-parameter model trained from random weights
    batch_size: int = 1                  # rows differ a lot in length: no padding waste at 1
    grad_accum: int = 1
    warmup_ratio: float = 0.05
    lr_scheduler: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 8192               # sft() refuses longer rows rather than let TRL cut their end off
    seed: int = 0                        # SFTRecipe.seed overrides it
    logging_steps: int = 1
    threads: int | None = None           # torch intra-op threads (None: torch's default)
    bf16: bool = False                   # bf16 autocast: ~1.3-2x faster on CPUs with AVX512-BF16, not bit-equal to fp32
    shuffle: bool = True                 # False: rows in the order given (a curriculum)
    group_by_length: bool = False        # shuffled batches of rows of about one length (transformers'
                                         # LengthGroupedSampler): level-4 rows padded to their batch's longest
                                         # are 1.45x their tokens at batch 8, grouped about 1.02x
    loss_on: list[str] | None = None     # only these parts of the calls (rows.action_parts: "replacement",
                                         # "path", ...) carry the loss; None: every action token

    def __post_init__(self) -> None:
        if not self.epochs > 0:   # (nan too)
            raise CRRError(f"epochs must be positive, got {self.epochs}")
        if self.batch_size < 1 or self.grad_accum < 1:
            raise CRRError("batch_size and grad_accum must be at least 1")
        if not self.learning_rate > 0:
            raise CRRError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.group_by_length and not self.shuffle:
            raise CRRError("group_by_length shuffles the rows; it cannot keep them in order (shuffle: false)")
        if self.loss_on is not None:
            parts = {"tool"} | {k for t in TOOL_SCHEMAS for k in t["function"]["parameters"]["properties"]}
            if not self.loss_on or set(self.loss_on) - parts:
                raise CRRError(f"loss_on takes some of {', '.join(sorted(parts))}, got {self.loss_on}")
            self.loss_on = list(self.loss_on)



# ----------------------------------------------------------------------------- training

class _Report(TrainerCallback):
    """Forwards the trainer's log records (loss, learning rate, token accuracy) and step progress."""

    def __init__(self, log_fn: Callable[[dict], None] | None, progress_fn: Callable[[int, int], None] | None):
        self.log_fn, self.progress_fn = log_fn, progress_fn

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.log_fn is not None and logs:
            self.log_fn({"step": state.global_step, "epoch": state.epoch, **logs})

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress_fn is not None:
            self.progress_fn(state.global_step, state.max_steps)


class _TokenCount(TrainerCallback):
    """TRL's count of trained tokens (num_tokens) across a resume: TRL keeps it in memory and counts from 0
    again, so each checkpoint gets the count it was saved at (FILE), and `restore` reads it back."""
    FILE = "crr_num_tokens.json"

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}" / self.FILE
        path.write_text(json.dumps({"num_tokens": self.trainer._total_train_tokens}) + "\n")

    def restore(self, checkpoint: str) -> None:
        saved = Path(checkpoint) / self.FILE
        if saved.is_file():   # a checkpoint saved before this count was kept restarts it, as TRL does
            self.trainer._total_train_tokens = json.loads(saved.read_text())["num_tokens"]


def action_nll(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed negative log-likelihood of the labelled (action) tokens of a collated batch, their count and
    how many of them are the model's top-1 token, with the LM head applied to those positions alone.

    Written by hand because TRL's fused LM head (trl.trainer.utils.add_fused_lm_head) projects only the
    labelled positions on Triton devices; on a CPU it projects every position, in fp32, with their entropy:
    half the step time of the tiny model, of whose tokens about a fifth carry the loss (`crr model
    sft-bench` times the two)."""
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    backbone = model.base_model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
    logits = model.get_output_embeddings()(backbone.last_hidden_state[:, :-1][mask]).float()
    target = labels[mask]
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    return nll, mask.sum(), (logits.argmax(-1) == target).sum()


def action_token_loss(trainer, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer.compute_loss on action_nll: TRL's loss (the mean NLL over the labelled tokens, or over the
    trainer's count of them under gradient accumulation) and its token-accuracy and token-count metrics."""
    if return_outputs:
        raise CRRError("the action-token loss returns no logits")
    nll, tokens, top1 = action_nll(model, inputs)
    loss = nll / torch.as_tensor(tokens if num_items_in_batch is None else num_items_in_batch).clamp(min=1)
    mode = "train" if model.training else "eval"
    trainer._metrics[mode]["mean_token_accuracy"].append((top1 / tokens.clamp(min=1)).item())
    if mode == "train":
        trainer._total_train_tokens += int(inputs["attention_mask"].sum())
        trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]
    return loss


def only_parts(dataset: Dataset, grammar: ToolCallGrammar, parts: list[str]) -> Dataset:
    """The rows with the loss mask kept only on the tokens that write these parts of the calls."""
    keep = set(parts)
    masks = [[int(p in keep) for p in action_parts(grammar, ids, mask)]
             for ids, mask in zip(dataset["input_ids"], dataset["assistant_masks"])]
    return dataset.remove_columns("assistant_masks").add_column("assistant_masks", masks)


def sft(model_dir: Path | str, dataset: Dataset, out_dir: Path | str, settings: SFTSettings | None = None, *,
        agent: tuple[str, int] | None = None, checkpoints: Path | str | None = None, resume: bool = False,
        on_log: Callable[[dict], None] | None = None,
        progress: Callable[[int, int], None] | None = None) -> Path:
    """Fine-tune the model in `model_dir` on `dataset` (from build_sft_dataset) with TRL's SFTTrainer and
    save the model and tokenizer to `out_dir` (new or empty; written atomically).

    `agent` (format name, H) is recorded in the model directory (crr.policy.model.AGENT_FILE): the format
    of the rows, which commands then use for this model. `checkpoints` keeps a checkpoint per epoch there;
    with `resume`, training continues from the latest one. Without it, checkpoints go to a temporary
    directory that is removed at the end."""
    from trl import SFTConfig, SFTTrainer  # deferred: TRL's trainers take seconds to import

    settings = settings or SFTSettings()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CRRError(f"{out} already exists and is not an empty directory; pass a new output directory")
    missing = {"input_ids", "assistant_masks"} - set(dataset.column_names)
    if missing:
        raise CRRError(f"the SFT dataset lacks {sorted(missing)}; build it with build_sft_dataset")
    if resume and checkpoints is None:
        raise CRRError("resume needs the checkpoints directory of the interrupted run")
    too_long = sum(len(ids) > settings.max_length for ids in dataset["input_ids"])
    if too_long:
        raise CRRError(f"{too_long} rows are longer than max_length={settings.max_length} tokens; TRL would "
                       "cut their last actions off; raise max_length or rebuild the data with a smaller "
                       "max_tokens")
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)

    with quiet_hf():  # fp32 master weights whatever the saved dtype (a bf16 model would train in pure bf16, whose
        # updates round away; bf16=True autocasts the compute instead)
        model, tokenizer = load_policy(model_dir, dtype=torch.float32)
    tokenizer.padding_side = "right"  # for training; load_policy's left padding is for generation
    if settings.loss_on is not None:
        dataset = only_parts(dataset, ToolCallGrammar(tokenizer), settings.loss_on)
    own_ckpt = checkpoints is None
    ckpt_dir = Path(tempfile.mkdtemp(prefix="crr-sft-")) if own_ckpt else Path(checkpoints)
    config = SFTConfig(
        output_dir=str(ckpt_dir), num_train_epochs=settings.epochs, learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.batch_size, gradient_accumulation_steps=settings.grad_accum,
        warmup_steps=settings.warmup_ratio,  # transformers reads a float < 1 as a fraction of the steps
        lr_scheduler_type=settings.lr_scheduler, weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm, max_length=settings.max_length,
        seed=settings.seed, data_seed=settings.seed, logging_steps=settings.logging_steps,
        # CPU: no activation recomputation (the model is small; it would only cost time), no dataloader
        # workers (2 cores).
        bf16=settings.bf16, use_cpu=not torch.cuda.is_available(), activation_checkpointing=False,
        dataloader_num_workers=0, save_strategy="epoch", save_total_limit=1, report_to="none", disable_tqdm=True,
        train_sampling_strategy=("group_by_length" if settings.group_by_length
                                 else "random" if settings.shuffle else "sequential"),
        # The mask comes with the rows (assistant_masks); assistant_only_loss would re-render `messages`.
        assistant_only_loss=False, completion_only_loss=False)

    class ActionTokenSFTTrainer(SFTTrainer):
        compute_loss = action_token_loss

    try:
        with quiet_hf():
            trainer = ActionTokenSFTTrainer(model=model, args=config,
                                            train_dataset=dataset.select_columns(["input_ids", "assistant_masks"]),
                                            processing_class=tokenizer, callbacks=[_Report(on_log, progress)])
            trainer.remove_callback(PrinterCallback)  # it prints every log record; `on_log` gets them instead
            tokens = _TokenCount(trainer)
            trainer.add_callback(tokens)
            checkpoint = get_last_checkpoint(str(ckpt_dir)) if resume and ckpt_dir.is_dir() else None
            if checkpoint is not None:
                tokens.restore(checkpoint)
            trainer.train(resume_from_checkpoint=checkpoint)
        with building(out, keep_theirs=lambda _: False) as tmp:
            with quiet_hf():
                trainer.save_model(str(tmp))
            tokenizer.padding_side = "left"
            tokenizer.save_pretrained(tmp)
            record = {"settings": asdict(settings), "base_model": str(model_dir), "rows": len(dataset)}
            (tmp / "crr_sft.json").write_text(json.dumps(record, indent=2) + "\n")
            if agent is not None:
                write_agent_record(tmp, *agent)
    finally:
        if own_ckpt:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    log.info("saved the warm-started model to %s", out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m crr.sft.trainer", description=__doc__.split("\n")[0])
    parser.add_argument("model", help="the model directory to warm-start")
    parser.add_argument("out", help="new directory for the warm-started model")
    parser.add_argument("data", nargs="+", help="expert data saved by crr sft --data-only (run dirs' expert_data/), "
                        "or the same rows as .parquet (e.g. int16 ids, to carry them compactly)")
    parser.add_argument("--settings", default="{}", help="SFTSettings fields as JSON")
    parser.add_argument("--agent", default=None, help="FORMAT:H recorded in the model (e.g. compact:8)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    agent = None
    if args.agent:
        name, turns = args.agent.split(":")
        agent = (name, int(turns))
    start = __import__("time").perf_counter()
    parts = [(Dataset.from_parquet(d) if d.endswith(".parquet") else Dataset.load_from_disk(d))
             .select_columns(["input_ids", "assistant_masks"]) for d in args.data]
    rows = datasets.concatenate_datasets(parts).cast(datasets.Features(
        input_ids=datasets.Sequence(datasets.Value("int64")),
        assistant_masks=datasets.Sequence(datasets.Value("int64"))))
    sft(args.model, rows, args.out, SFTSettings(**json.loads(args.settings)),
        agent=agent, on_log=lambda r: print(json.dumps(r), flush=True))
    print(json.dumps({"event": "done", "wall_s": __import__("time").perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
