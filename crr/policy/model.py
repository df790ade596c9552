"""The policy model: the embedded tiny default and loading any causal LM.

The default is a small Qwen3-architecture model with random weights and a byte-level BPE tokenizer
trained offline on the embedded corpus (crr.policy.corpus). Its chat template is TRL's own
`qwen3_instruct_2507` text, chosen because TRL 1.16 recognises it for tool calling
(`add_response_schema` maps it to the Qwen3 response parser) and it is prefix-preserving, so
GRPOTrainer keeps it rather than swapping in a training template; `get_training_chat_template`
maps it to TRL's `{% generation %}` variant for assistant-only SFT loss. (`qwen3.jinja` is
recognised too but drops <think> blocks from history, so it is not prefix-preserving.)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import trl.chat_template_utils as trl_templates
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from crr.errors import CRRError
from crr.policy import check_model
from crr.policy.corpus import corpus
from crr.sandbox.checkout import building

log = logging.getLogger(__name__)
# transformers logs through Python logging like every other library, not through a stderr handler of its own:
# the CLI sends library records to the run directory's log (to the terminal with --verbose)
hf_logging.disable_default_handler()
hf_logging.enable_propagation()

MODEL_VERSION = "1"  # bump when the recipe below changes: it keys the cache of the default model
# bump when crr.sft.warm_start.SFTRecipe's defaults change: it keys the cached warm-started default
SFT_RECIPE_VERSION = "1"
CHAT_TEMPLATE = "qwen3_instruct_2507"
VOCAB_SIZE = 6144
CORPUS_SEED = 0  # the tokenizer is part of the recipe: every model seed shares it
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen keeps the tool tags as added but non-special tokens, so decoding with skip_special_tokens
# (as TRL does before parsing tool calls) leaves them in the text.
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2/3's pre-tokenizer split: single digits, letter runs, punctuation runs, newlines.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SIZES: dict[str, dict[str, int]] = {
    # about 4.4M parameters (1.2M of them the tied embedding)
    "tiny": {"hidden_size": 192, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 6,
             "num_key_value_heads": 2, "head_dim": 32},
    # about 13.8M parameters
    "small": {"hidden_size": 320, "intermediate_size": 1280, "num_hidden_layers": 8, "num_attention_heads": 10,
              "num_key_value_heads": 2, "head_dim": 32},
}


def chat_template() -> str:
    return getattr(trl_templates, f"{CHAT_TEMPLATE}_chat_template")


def train_tokenizer(vocab_size: int = VOCAB_SIZE, extra: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """A Qwen-style byte-level BPE tokenizer trained on the embedded corpus (deterministic), and on `extra`
    documents after it when given (e.g. nano modules, so that their pseudo-words get merges of their own)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(itertools.chain(corpus(chat_template(), seed=CORPUS_SEED), extra), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        clean_up_tokenization_spaces=False, model_max_length=8192)
    tokenizer.chat_template = chat_template()
    # Sets the response parser TRL's tool loop and `parse_response` use (ValueError if unrecognised).
    return trl_templates.add_response_schema(tokenizer)


# The first alternative of _QWEN_SPLIT for letter runs, which carries a leading space (or punctuation) along,
# and the same alternative after split_word_spaces, which carries punctuation only.
_LETTER_RUN = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_LETTER_RUN_NO_SPACE = r"[^\r\n\p{L}\p{N} ]?\p{L}+"


def split_word_spaces(tokenizer_json: dict) -> dict:
    """A Qwen-style tokenizer (as tokenizer.json holds it) re-split so that a space stays on a letter run only
    where the run with its space is one token of the vocabulary (` return`, ` min`, ` if`); before any other
    run, as the nano tier's pseudo-word names are (` niljos`), the space becomes a token of its own and the run
    starts without one (`n`, `il`, `j`, `os`). Same vocabulary and merges, so a model keeps its weights.

    Why (issue 11): teacher-forced, the default writes the first token of a name in an edit right about 10 %
    of the time when that token is a space-led onset (` k`, ` b`, ` po`: frequent, nearly parallel
    embeddings, all followed by unpredictable syllables) and about 95 % when it is not (`(b`, `k`); re-split,
    every name that is not itself one space-led token starts with a token of the second kind
    (research/name_copy_probe.py, research/copy_lever_probe.py).
    """
    out = json.loads(json.dumps(tokenizer_json))
    split = out["pre_tokenizer"]["pretokenizers"][0]["pattern"]
    if _LETTER_RUN_NO_SPACE in split["Regex"]:
        return out  # already re-split
    if _LETTER_RUN not in split["Regex"]:
        raise CRRError("split_word_spaces takes a Qwen-style byte-level tokenizer (crr's own or Qwen's)")
    space = "\u0120"  # how byte-level BPE spells a space in its vocabulary
    words = sorted({t[1:] for t in out["model"]["vocab"] if t.startswith(space) and t[1:].isascii()
                    and t[1:].isalpha()}, key=lambda w: (-len(w), w))
    whole = " (?:" + "|".join(words) + r")(?!\p{L})"
    split["Regex"] = split["Regex"].replace(_LETTER_RUN, f"{whole}|{_LETTER_RUN_NO_SPACE}", 1)
    return out


def write_split_model(model_dir: Path | str, out_dir: Path | str) -> Path:
    """A copy of `model_dir` whose tokenizer is re-split by split_word_spaces (kept if `out_dir` has one)."""
    out = Path(out_dir)
    if (out / "tokenizer.json").is_file():
        return out
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise CRRError(f"no tokenizer.json in {model_dir}: re-splitting needs a local model directory")
    with building(out, keep_theirs=lambda d: (d / "tokenizer.json").is_file()) as tmp:
        shutil.copytree(model_dir, tmp)
        tokenizer_json = json.loads((tmp / "tokenizer.json").read_text())
        (tmp / "tokenizer.json").write_text(json.dumps(split_word_spaces(tokenizer_json), ensure_ascii=False))
    return out


def init_tiny_model(out_dir: Path | str, seed: int = 0, size: str = "tiny") -> Path:
    """Build the default policy (random Qwen3 weights from `seed`, trained tokenizer) into `out_dir`.

    Written to a temporary sibling first and renamed into place, so a crash or a concurrent build never
    leaves a half-written model behind. `out_dir` must not exist or be empty.
    """
    if size not in SIZES:
        raise CRRError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CRRError(f"{out} already exists and is not an empty directory; pass a new --out path")
    tokenizer = train_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with building(out, keep_theirs=lambda _: False) as tmp, quiet_hf():
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    log.info("wrote a %s model (%d parameters, vocab %d) to %s", size, param_count(model), len(tokenizer), out)
    return out


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No tqdm bars from datasets and transformers (library code; the CLI draws its own) while a model is saved
    or trained."""
    import datasets  # deferred: a heavy library that loading a policy does not need

    was_datasets = datasets.is_progress_bar_enabled()
    was_hf = hf_logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_datasets:
            datasets.enable_progress_bars()
        if was_hf:
            hf_logging.enable_progress_bar()


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def load_policy(path_or_hub_id: Path | str, device: str = "cpu",
                dtype: torch.dtype | str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any causal LM transformers can load (local directory or hub id), ready for left-padded batches."""
    name = str(path_or_hub_id)
    check_model(name, name, adapter=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype if dtype is not None else "auto")
    except (OSError, ValueError) as e:  # missing files, unknown hub id, no tokenizer in the directory
        raise CRRError(f"cannot load a model from {name!r} ({' '.join(str(e).split())}); pass a directory made by "
                       "`crr model init` or a hub id that is in the local Hugging Face cache") from None
    if not tokenizer.chat_template:
        raise CRRError(f"{name} has no chat template; crr renders tool conversations with it")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def frozen_base(model: torch.nn.Module) -> PreTrainedModel:
    """The base of a LoRA (PEFT) policy as a module of its own, holding the very tensors of the base weights (no
    copy): the policy with its adapter disabled, without disabling it. The trainer's reference policy, so that
    computing the reference log-probabilities leaves the live policy's adapter alone while branches decode from
    it in another thread (crr.train.trainer, branches_beside_update)."""
    base = model.get_base_model()
    weights = {name.replace(".base_layer.", "."): t for name, t in base.state_dict().items() if ".lora_" not in name}
    with torch.device("meta"):   # the architecture without allocating weights: each is assigned the base's tensor
        module = type(base)(base.config)
    missing, unexpected = module.load_state_dict(weights, strict=False, assign=True)
    module.tie_weights()
    if unexpected or {n for n, p in module.named_parameters() if p.is_meta}:
        raise CRRError(f"cannot take the base of the policy's adapter: missing {missing}, unexpected {unexpected}")
    for name, buffer in base.named_buffers():   # non-persistent buffers (rotary frequencies) are in no state dict
        owner, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buffer
    return module.eval().requires_grad_(False)


def cache_dir() -> Path:
    return Path(os.environ.get("CRR_CACHE_DIR") or Path.home() / ".cache" / "crr")


def default_model_dir() -> Path:
    """The tiny default model in the crr cache, built on first use."""
    path = cache_dir() / "models" / f"tiny-{MODEL_VERSION}"
    if not (path / "config.json").is_file():
        log.info("building the default tiny model into %s (first use, a few seconds)", path)
        try:
            init_tiny_model(path)
        except CRRError:
            if not (path / "config.json").is_file():  # not a concurrent build that won the rename
                raise
    return path


# A model directory records how it was trained to see episodes; commands use it unless told otherwise.
AGENT_FILE = "crr_agent.json"   # {"agent_format": name in crr.agent.prompt.FORMATS, "max_turns": H}
# The warm-started default shipped with crr (weights, tokenizer, recipe and measured pass@1 beside them;
# rebuilt by `crr sft --recipe experiments/sft-nano.yaml`).
SHIPPED_DEFAULT = Path(__file__).parent / "default"


def write_agent_record(model_dir: Path | str, agent_format: str, max_turns: int) -> None:
    (Path(model_dir) / AGENT_FILE).write_text(json.dumps({"agent_format": agent_format, "max_turns": max_turns},
                                                          indent=2) + "\n")


def agent_record(*models: Path | str | None) -> dict:
    """The agent record of the first of `models` (model or adapter directories) that has one; {} if none."""
    for model in models:
        if model and (Path(str(model)).expanduser() / AGENT_FILE).is_file():
            return json.loads((Path(str(model)).expanduser() / AGENT_FILE).read_text())
    return {}


def default_policy_dir() -> Path:
    """The model every command uses when none is given: the shipped warm-started default, else the
    cached warm start of `crr sft`'s default recipe if built, else the random tiny default."""
    if (SHIPPED_DEFAULT / "config.json").is_file():
        return SHIPPED_DEFAULT
    sft = default_sft_model_dir(build=False)
    return sft if (sft / "config.json").is_file() else default_model_dir()


def default_sft_model_dir(build: bool = False) -> Path:
    """Where `crr sft` caches the tiny default warm-started by its default recipe (`crr sft` with no options
    installs it here). Nothing builds it on demand: the shipped default (SHIPPED_DEFAULT) is the warm start
    commands use. With `build`, a missing one is an error that says how to make it."""
    path = cache_dir() / "models" / f"tiny-{MODEL_VERSION}-sft-{SFT_RECIPE_VERSION}"
    if build and not (path / "config.json").is_file():
        raise CRRError(f"no warm-started default in {path}; make it with `crr sft` (the default recipe)")
    return path
