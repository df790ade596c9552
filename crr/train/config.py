"""One config for `crr train`: TRL's GRPOConfig (every learner knob) plus the CRR fields, with the
paper's loss set explicitly where TRL 1.16's defaults differ (../shared/notes/trl.md, section 3).

Presets live in experiments/ (flat YAML: any field below or of GRPOConfig, plus `base: other.yaml` to start
from another preset); the CPU preset is the embedded default. `load_config(preset, overrides)` applies
`key=value` overrides (values parsed as YAML; a dotted key such as `crr.k=2` or `trl.beta=0.0` names the
same flat field, the prefix only says which part it belongs to).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from trl import GRPOConfig

from crr.agent.prompt import agent_format
from crr.errors import CRRError
from crr.experiments import EXPERIMENTS, override, read_preset
from crr.policy import DTYPES, SERVER_BACKEND, check_backend, check_model
from crr.sandbox import engine_spec_of
from crr.train.advantages import check as check_estimator
from crr.train.distributed import launched_processes
from crr.train.selectors import PREFIX_SELECTORS, STATE_SELECTORS
from crr.train.values import RANGES, check_value

DEFAULT_PRESET = EXPERIMENTS / "cpu-crr.yaml"


@dataclass(frozen=True)
class Method:
    """What a method collects for its advantage estimator (crr.train.advantages), one row of METHODS."""
    estimator: str                 # the advantage_estimator it defaults to
    selects: bool = False          # the selector picks up to k steps of every scored trajectory (RowCredit.selected)
    forks: str | None = None       # None; "counterfactual": K alternative actions a~_t != a_t at each selected
    #                                step, each run forward (RowCredit.counterfactuals); "continuation": K
    #                                on-policy continuations from every non-terminal s_t (RowCredit.continuations);
    #                                "reset": M = cf_samples on-policy continuations from one picked state of a
    #                                failed trajectory per task, trained as M of its G rows (RowCredit.reset)
    swaps: bool = False            # Search-Select: a row is replaced by its verifier-best branch, and the
    #                                ratio is taken against the behaviour policy that generated each row
    state_keys: bool = False       # record tree digests: RowCredit.state_keys
    control: str | None = None     # the estimator under zero_contrast=true (selected steps, no forks)


METHODS = {
    "grpo": Method("grpo"),
    "crr": Method("crr", selects=True, forks="counterfactual", control="zero_contrast"),
    "search-select": Method("search_select", selects=True, forks="counterfactual", swaps=True),
    "gigpo": Method("gigpo", state_keys=True),
    "mc-values": Method("mc_values", forks="continuation"),
    "resets": Method("resets", selects=True, forks="reset"),
}
_PREFIXES = ("crr.", "trl.")


@dataclass
class CRRConfig(GRPOConfig):
    # --- what is trained, on what
    method: str = field(default="crr", metadata={"help": " | ".join(METHODS)})
    model: str | None = field(default=None, metadata={"help": "model directory or hub id; None: the warm-started "
                                                                "tiny default if built, else the tiny default"})
    tasks: str = "micro-train"
    n_tasks: int | None = None                 # use the first N tasks
    tasks_per_iteration: int = 1               # prompts per generation batch (each x G siblings)
    engine: str = "local"                      # local, docker, ray:<engine>, or pkg.module:Class (crr.sandbox.engines)
    engine_options: dict = field(default_factory=dict)  # the engine's options (docker: image, mem_limit, cpus, ...)
    ray: str | None = None                     # a ray:... engine's cluster address, as ray.init takes it (None: auto)
    mode: str | None = None                    # the Docker engine's mode: commit or overlay (an engine option)
    workers: int | None = None                 # concurrent tool executions (None: 4, or a Ray engine's slots)
    # --- episodes (the paper's H, rollout temperature)
    max_turns: int = 50
    max_new_tokens: int = 512
    rollout_temperature: float = 0.6           # sampling; TRL's `temperature` stays 1 (the loss is on pi_theta)
    episode_time_limit_s: float = 3600.0
    reuse_verdicts: bool = True                # an episode ending in a state an earlier one of the run ended in
    #                                            takes its verdict instead of a test run (crr.agent.verdicts)
    agent_format: str | None = None            # crr.agent.prompt.FORMATS; None: the model's recorded one, else "paper"
    drafts: bool = True                        # decode with guesses of a call's tokens from the episode's earlier
    #                                            calls and a branch's trajectory (crr.policy.drafts): fewer
    #                                            decoding passes, the same samples
    backend: str = "transformers"              # generation: transformers | vllm (in-process vLLM) | vllm-server
    #                                            (a vLLM server, TRL's vllm_mode="server"; CUDA); vLLM's weights
    #                                            are synced before every rollout
    vllm_server: str | None = None             # backend=vllm-server: the server's URL (TRL's vllm_server_base_url)
    dtype: typing.Literal[DTYPES] = "auto"     # the policy's weights while it generates and
    #                                            learns: auto = as saved (the shipped default's bf16); float32 on a
    #                                            CPU without AVX512-BF16, where bf16 arithmetic is emulated
    #                                            (docs/warm-start.md); a seed's trajectories differ between dtypes
    # --- CRR (Method; Hyperparameters table)
    selector: str = "entropy_type"
    proposal: str = "tempered"
    k: int = 4                                 # fork budget per trajectory
    cf_samples: int = 1                        # K counterfactuals per selected step (mc-values: continuations per
    #                                            state; resets: M restart rows per task, of its G)
    cf_temperature: float = 0.7                # T_cf
    eta: float = 0.4                           # entropy threshold
    lambda_type: float = 0.6
    horizon: int | None = None                 # counterfactual horizon h in steps; None: to the end
    zero_contrast: bool = False                # control: selected steps get A = 0, no forks
    reuse_played: bool = True                  # a fork whose a_t~ a sibling took in the same state takes the
    #                                            sibling's return, unplayed (crr.train.counterfactual.played_by;
    #                                            not for a method that swaps sequences: a duplicate row)
    forks_during_rollout: bool = False         # true: a fork starts in the round after its step is realised, its
    #                                            branch decoding in the rollout's rounds
    #                                            (crr.train.counterfactual.LiveForks; not with a selector outside
    #                                            PREFIX_SELECTORS or replay noise); no faster on 2 CPU cores
    #                                            (docs/training.md), so off
    branches_beside_update: bool = True        # the forks after the rollout run beside the update's reference
    #                                            and forward passes, joined when the loss reads the advantages:
    #                                            the same iteration, sooner (crr.train.trainer; a method whose
    #                                            rows wait for none of them: not Search-Select or resets; not
    #                                            under DeepSpeed or FSDP); false: before the update
    # --- the advantage estimator (crr.train.advantages): None = the method's; a registered name or a
    #     function by dotted path (mypkg.mod:fn), called with advantage_params as keywords
    advantage_estimator: str | None = None
    advantage_params: dict = field(default_factory=dict)
    fork_cost_multiplier: float = 1.0          # m: (m - 1) x measured fork cost added as a real delay
    replay_noise: float = 0.0                  # rho: share of branch steps whose output is resampled
    # --- LoRA (PEFT) or full fine-tuning
    use_lora: bool = True
    lora_r: int = 128
    lora_alpha: int = 256
    lora_target_modules: list[str] | str = "all-linear"
    # --- limits, checkpoints, diagnostics
    max_trajectories: int | None = None
    budget_hours: float | None = None
    checkpoint_fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0])
    save_every: int = 1                        # also keep the latest checkpoint every N updates (resume)
    diagnostics_every: int = 1                 # advantage SNR and bucket covariance every N updates
    keep_trajectories: bool = True             # every trajectory and branch to trajectories/ (crr.train.records)

    def __post_init__(self) -> None:
        validate(self)
        if self.method not in METHODS:
            raise CRRError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not isinstance(self.advantage_params, dict):
            raise CRRError(f"advantage_params must be a mapping of keyword parameters, got {self.advantage_params!r}")
        check_estimator(self.estimator, self.advantage_params)
        if self.row.forks == "reset" and not 2 <= self.cf_samples < self.num_generations:
            raise CRRError(f"method {self.method}: cf_samples={self.cf_samples} restart rows per task of "
                           f"num_generations={self.num_generations}; take 2 <= cf_samples < num_generations "
                           "(the restart rows' advantage is taken among them, and the on-policy rows are what they "
                           "reset from)")
        engine_spec_of(self)  # an option the engine does not take fails here
        if self.agent_format is not None:
            agent_format(self.agent_format)
        check_backend(self.backend, self.vllm_server)
        # One generation batch = one update: tasks_per_iteration x G rows, no gradient accumulation. Across
        # N processes (crr.train.distributed) each rolls out tasks_per_iteration / N whole groups.
        processes = launched_processes()
        if self.tasks_per_iteration % processes:
            raise CRRError(f"tasks_per_iteration={self.tasks_per_iteration} is not a multiple of the {processes} "
                           "processes: each process rolls out whole groups (all G siblings of its tasks)")
        self.per_device_train_batch_size = self.tasks_per_iteration * self.num_generations // processes
        self.gradient_accumulation_steps = 1
        self.steps_per_generation = None
        self.generation_batch_size = None      # derived: per-process batch x processes
        if self.max_trajectories is not None:
            updates = math.ceil(self.max_trajectories / (self.tasks_per_iteration * self.num_generations))
            self.max_steps = updates if self.max_steps is None or self.max_steps <= 0 else min(self.max_steps, updates)
        super().__post_init__()
        unknown = [r for r in self.report_to if r not in INTEGRATION_TO_CALLBACK]   # TRL's check: once it trains
        if unknown:
            raise CRRError(f"report_to: unknown integration(s) {unknown}; choose from none, "
                           f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if self.world_size != processes:
            raise CRRError(f"launched as {processes} processes, but they did not join one process group "
                           f"(world size {self.world_size}): without GPUs set use_cpu=true (gloo on CPU)")
        if self.backend == SERVER_BACKEND and (self.use_cpu or not torch.cuda.is_available()):
            raise CRRError(f"backend={SERVER_BACKEND} needs a CUDA trainer: the policy's weights reach the vLLM server "
                           "after every update only through TRL's NCCL transfer, so on CPU the server would sample "
                           "from stale weights (off-policy); train with backend=vllm or transformers here")

    @property
    def row(self) -> Method:
        return METHODS[self.method]

    @property
    def control(self) -> bool:
        """The zero-contrast control of a method that has one (it selects but never forks)."""
        return self.zero_contrast and self.row.control is not None

    @property
    def estimator(self) -> str:
        return self.advantage_estimator or (self.row.control if self.control else self.row.estimator)

    @property
    def forks(self) -> str | None:
        """What iterations fork: "counterfactual", "continuation", "reset" or None."""
        if self.row.forks == "counterfactual" and (self.control or self.k == 0):
            return None
        return self.row.forks

    @property
    def on_policy_group(self) -> int:
        """The on-policy trajectories of a task per update: G, less the M restart rows of method resets."""
        return self.num_generations - (self.cf_samples if self.forks == "reset" else 0)

    @property
    def live_forks(self) -> bool:
        """Whether forks start during the rollout (forks_during_rollout, where the selector and replay noise allow)."""
        return (self.forks_during_rollout and self.forks in ("counterfactual", "continuation") and not self.replay_noise
                and (self.forks == "continuation" or self.selector in PREFIX_SELECTORS))

    @property
    def branches_beside(self) -> bool:
        """Whether the forks after the rollout run beside the update (branches_beside_update, for a method whose
        rows do not wait for them)."""
        return (self.branches_beside_update and self.forks in ("counterfactual", "continuation") and not self.row.swaps
                and not self.live_forks)

    @property
    def state_keys(self) -> bool:
        """Whether rollouts record tree digests (RowCredit.state_keys; the selectors that read them)."""
        return self.row.state_keys or (self.row.selects and self.selector in STATE_SELECTORS)

    def resolved(self) -> dict:
        """Every settable field, as written to the run directory's config.yaml (and read back on resume).
        Objects TRL derives in __post_init__ (the accelerator config) are left out: they are rebuilt."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.init and _is_plain(value):
                out[f.name] = value.value if isinstance(value, Enum) else value
        return out


@functools.cache
def _field_types() -> dict[str, object]:
    return typing.get_type_hints(CRRConfig)


def validate(cfg: CRRConfig) -> None:
    """Every field's type (from the annotations of CRRConfig and TRL's GRPOConfig) and range (RANGES), and that
    a model given as a directory holds a model: a CRRError naming the first bad field, before anything is made."""
    types_ = _field_types()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not f.init or value is None and f.default is None:
            continue
        check_value(f.name, value, types_[f.name], RANGES.get(f.name))
    if cfg.model is not None:
        check_model(cfg.model, f"model={cfg.model}", adapter=False)


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_is_plain(v) for v in value.values())
    return value is None or isinstance(value, (str, int, float, bool, Enum))


def parse_overrides(pairs: list[str]) -> dict:
    names = {f.name for f in dataclasses.fields(CRRConfig) if f.init}
    out = {}
    for pair in pairs:
        key, value = override(pair, "k=2 or crr.cf_temperature=0.5")
        for prefix in _PREFIXES:
            key = key.removeprefix(prefix)
        if key not in names:
            raise CRRError(f"unknown config key {key!r} in override {pair!r}; see experiments/cpu-crr.yaml")
        out[key] = value
    return out


def load_config(preset: Path | str | None = None, overrides: dict | None = None) -> CRRConfig:
    """A preset file (default: the CPU preset; `base: other.yaml` chains, crr.experiments.read_preset) with
    overrides applied; bad keys or values are CRRErrors."""
    path = Path(preset) if preset is not None else DEFAULT_PRESET
    data = read_preset(path)
    names = {f.name for f in dataclasses.fields(CRRConfig) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise CRRError(f"{path}: unknown config key(s) {unknown}")
    data.update(overrides or {})
    try:
        with warnings.catch_warnings():   # TRL 1.16 defaults the name transformers 5 deprecated: every config warns
            warnings.filterwarnings("ignore", message="`gradient_checkpointing", category=FutureWarning)
            return CRRConfig(**data)
    except (TypeError, ValueError) as e:   # TRL's own validation (its messages span lines: one here)
        raise CRRError(f"invalid config: {' '.join(str(e).split())}") from None


def paper_loss_settings() -> dict:
    """The knobs where TRL 1.16's defaults differ from the paper's loss (notes/trl.md, section 3)."""
    return {"loss_type": "grpo", "beta": 0.04, "epsilon": 0.2, "scale_rewards": "none",
            "use_bias_correction_kl": False, "vllm_importance_sampling_correction": False, "num_iterations": 1,
            "temperature": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95}
