"""The CRR trainer: TRL's GRPOTrainer fed by a multi-turn, forking rollout (paper: Algorithm 1; Method,
Eq. 3 and the loss; Appendix "Search-Select protocol", "Compute Accounting").

    cfg = load_config("experiments/cpu-crr.yaml", {"method": "crr"})
    run = start_run(cfg, "results/runs")
    summary = train(cfg, run)                    # or: cfg, run, ckpt = resume_run(path); train(cfg, run, ckpt)

Checkpoints (checkpoints/checkpoint-N) are published whole (`CRRTrainer._save_checkpoint`); a resume starts from
the newest complete one and cuts metrics.jsonl, the ledger and tuples/ back to it (`resume_run`).

One iteration = one TRL generation batch = one optimizer update:
  1. rollout_func (`_rollout`: `_sample`, `_select`, `_branch`, `_batch_rows`, `_rows`, `_keep`): G trajectories
     per task in sandboxes (crr.rollout, the prompts TRL repeats G times);
     what else an iteration collects is the method's row in config.METHODS: for a method that selects
     (crr, search-select, resets) the selector picks up to k steps of every scored trajectory, and each is
     forked K times (crr.train.counterfactual); mc-values plays K on-policy continuations from every
     state; resets plays G - M on-policy trajectories per task and M on-policy continuations from one state
     of a failed one (the selector's first pick, e.g. its first edit), which are the task's other M rows;
     with forks_during_rollout=true a fork starts during the rollout, in the round after its step is
     realised, and its branch decodes in the rollout's rounds (LiveForks). With branches_beside_update
     (the default) the forks after the rollout run in a helper thread beside step 2 and the forward pass of
     step 3, which need the rows but not their advantages, and are joined where the loss first reads the
     advantages (`_get_per_token_logps_and_entropies`): the same iteration, on a clock that no longer
     waits for them (the ledger charges them only the wait at the join: Ledger.beside). The branches go
     to tuples/ as one parquet part. A swapping method (Search-Select) replaces a
     realised row by its verifier-best branch when that branch scores strictly higher. The rows go back
     to TRL with env_mask (observations masked) and, per row, the same credit record (RowCredit) for
     whichever advantage estimator the config names.
  2. _generate_and_score_completions (the one override, as notes/trl.md section 1 says): TRL's own
     scoring runs first (reference log-probabilities, its logging); then the (B, T) advantages from the
     config's estimator (advantage_estimator, by default the method's) replace TRL's (B,) ones, and
     rows whose trajectory hit an infrastructure failure are masked out of the loss entirely. With
     keep_trajectories, the update's trajectories and branches go to trajectories/ with these advantages
     and GRPO's (crr.train.records).
  3. TRL's clipped surrogate + beta KL with the paper's settings (config.paper_loss_settings); then the
     callback closes the ledger iteration, logs (metrics.jsonl, and as crr/... scalars through TRL's log to
     every report_to integration), checkpoints and enforces the budget.

Across N processes (`accelerate launch --num_processes N -m crr train`, crr.train.distributed) each process
runs steps 1-3 on its tasks_per_iteration / N whole groups with its own engine; the tuples, the iteration's
statistics, the ledger and the advantage credits are gathered so that every process holds the whole
iteration, and only the main process writes the run directory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig, PeftModel
from safetensors import SafetensorError
from transformers import PrinterCallback, ProgressCallback, TrainerCallback, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import add_fused_lm_head

from crr.agent.episode import EpisodeConfig, Trajectory
from crr.agent.verdicts import Verdicts
from crr.errors import CRRError
from crr.policy import SERVER_BACKEND
from crr.policy.backend import TransformersBackend
from crr.policy.model import agent_record, default_policy_dir, frozen_base, load_policy, write_agent_record
from crr.sandbox import engine_spec_of
from crr.sandbox.checkout import publish
from crr.rollout import RolloutConfig, RolloutResult, in_background, rollout, rollout_pool
from crr.rundir import RunDir, as_made
from crr.seeds import derive_seed
from crr.tasks.loaders import load_tasks
from crr.tasks.schema import Task
from crr.train import records
from crr.train.advantages import (
    RowCredit,
    estimate,
    search_select_choice,
    state_groups,
    state_keys,
    token_advantages,
)
from crr.train.config import CRRConfig, load_config, paper_loss_settings, parse_overrides
from crr.train.counterfactual import (
    Branch,
    LiveForks,
    continuation_points,
    continuations,
    reset_points,
    run_branches,
)
from crr.train.diagnostics import advantage_snr, bucket_covariance, prefix_signature
from crr.train.distributed import barrier, broadcast, gather, gather_one, is_main
from crr.train.ledger import Ledger, merge
from crr.train.replay_noise import RerunOutputs
from crr.train.selectors import SelectorParams, select_each, sibling_values
from crr.train.shared_prompt import shared_prompt_logps
from crr.train.tuples import drop_parts_from, write_part

log = logging.getLogger(__name__)
CHECKPOINTS = "checkpoints"
STAGING = ".staging"   # checkpoints/.staging/checkpoint-N: a checkpoint being saved, renamed into place once whole
RESUMABLE = ("max_steps", "budget_hours")   # what `--resume` may change: when to stop, not what is trained
# What a checkpoint must hold to resume from: TRL's trainer state, the optimizer's state (unless the run saves
# only the model; DeepSpeed keeps it in global_step*/ named by `latest`) and the weights (adapter or model).
TRAINER_STATE, OPTIMIZER, DEEPSPEED_LATEST = "trainer_state.json", "optimizer.pt", "latest"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
           "pytorch_model.bin", "pytorch_model.bin.index.json")
# How saving weights fails on a full or read-only disk: torch says RuntimeError ("unexpected pos ..."), safetensors
# its own error, the rest OSError.
SAVE_ERRORS = (OSError, RuntimeError, SafetensorError)


def save_failed(path: Path, run_path: Path, e: Exception) -> CRRError:
    """One line for a save of `path` that failed (SAVE_ERRORS), with the space left, since torch's words are cryptic."""
    free = shutil.disk_usage(run_path).free / 2**20
    return CRRError(f"cannot save {path}: {' '.join(str(e).split())[:200]} ({free:.0f} MiB free there)")


def verifier_reward(completions, reward, **kwargs) -> list[float | None]:
    """R(tau) as the rollout recorded it; None (an infrastructure failure) makes TRL skip the row."""
    return [None if r is None else float(r) for r in reward]


def resolve_model(cfg: CRRConfig) -> str:
    return cfg.model if cfg.model is not None else str(default_policy_dir())


class CRRTrainer(GRPOTrainer):
    def __init__(self, cfg: CRRConfig, model, tokenizer, tasks: list[Task], run: RunDir, engine, *,
                 on_iteration: Callable[[dict], None] | None = None):
        for key, value in paper_loss_settings().items():
            if key not in ("adam_beta1", "adam_beta2") and getattr(cfg, key) != value:
                log.warning("config sets %s=%r; the paper's loss uses %r", key, getattr(cfg, key), value)
        self.cfg, self.run, self.engine, self.tasks = cfg, run, engine, {t.instance_id: t for t in tasks}
        self.ledger = Ledger(run, cfg.fork_cost_multiplier, writer=is_main())
        self.pool = rollout_pool(engine, cfg.workers)  # rollouts and forks; unset: a Ray engine's slots
        self.verdicts = Verdicts() if cfg.reuse_verdicts else None   # the run's verdicts by final state
        self.episode = EpisodeConfig(max_turns=cfg.max_turns, temperature=cfg.rollout_temperature,
                                     max_new_tokens=cfg.max_new_tokens, time_limit_s=cfg.episode_time_limit_s,
                                     snapshots=cfg.forks is not None, digests=cfg.state_keys,
                                     agent_format=cfg.agent_format or "paper", drafts=cfg.drafts)
        self.backend: TransformersBackend | None = None
        self.weight_syncs = 0   # backend=vllm or vllm-server: pushes of the policy's weights into vLLM
        self.iteration: dict = {}
        self.records: dict | None = None   # this update's trajectory records until its advantages are known
        self.live: LiveForks | None = None   # this update's forks started during its rollout (cfg.live_forks)
        peft_config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                                 target_modules=cfg.lora_target_modules) if cfg.use_lora else None
        super().__init__(model=model, reward_funcs=verifier_reward, args=cfg, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"prompt": [t.instance_id for t in tasks]}),
                         peft_config=peft_config, rollout_func=self._rollout,
                         callbacks=[_IterationCallback(self, on_iteration)])
        # library code does not print: TRL's log records go to metrics.jsonl (_IterationCallback.on_log), not
        # to the terminal as raw dicts, and the CLI draws the progress (one line per update, a bar)
        self.remove_callback(PrinterCallback)
        self.remove_callback(ProgressCallback)
        # the reference policy of a new LoRA adapter as a module of its own (the base weights themselves, shared):
        # for its log-probabilities TRL would otherwise disable the adapter of the live policy, from which the
        # branches beside the update decode (cfg.branches_beside) on a GPU (on a CPU they decode from a merged
        # copy, TransformersBackend); the same numbers, bit for bit
        if (self.beta != 0.0 and self.ref_model is None and isinstance(self.model, PeftModel)
                and "ref" not in self.model.peft_config and not self.args.cast_lm_head_to_fp32 and not self._sharded):
            self.ref_model = frozen_base(self.model)
            add_fused_lm_head(self.ref_model, temperature=self.temperature)
        self._branching = ExitStack()   # the policy generating and, beside the update, the branches still running
        self._late: tuple | None = None   # (finish, ledger before, branches) of the rollout they have not ended

    @property
    def _sharded(self) -> bool:
        """DeepSpeed or FSDP: the policy's parameters are gathered for generation, not while the update runs."""
        return self.is_deepspeed_enabled or self.is_fsdp_enabled

    # ------------------------------------------------------------------ 1. rollouts and forks
    def _rollout(self, prompts: list[str], trainer: GRPOTrainer) -> dict:
        """Algorithm 1 up to the advantages (TRL's rollout_func): this process's rows of one iteration, each
        with its credit record; the advantages (line 10) and the update (line 11) follow in
        _generate_and_score_completions and TRL's optimizer step. With cfg.branches_beside the rows go back
        before the branches have ended: they run on in a helper thread beside the update's first half (TRL's
        reference pass and the loss's forward pass, which need the rows, not their advantages), and are
        joined (`_land`) when the advantages are first read, after that forward pass
        (`_get_per_token_logps_and_entropies`). The same seed gives the same iteration either way."""
        step, seed, tasks, offset = self._batch(prompts)
        self.ledger.begin(step)
        reused = self.verdicts.reused if self.verdicts is not None else 0
        try:
            self._branching.enter_context(self._generating())
            result = self._sample(tasks, seed, step)                            # G on-policy trajectories per task
            trajs = result.trajectories
            picks = self._select(trajs, seed) if self.cfg.row.selects else {}  # the steps to fork
            fresh = {}
            if self.cfg.forks == "reset":                                       # one state per task
                picks, fresh = reset_points(trajs, picks)
            points = {**picks, **fresh}
            finish = functools.partial(self._finish, step, offset, result, picks, reused)
            if self.cfg.branches_beside and not self._sharded:                # K branches from each, beside
                before = self.ledger.snapshot()
                branching = self._branching.enter_context(in_background(lambda: self._branch(trajs, points, seed)))
                self._late = (finish, before, branching)
                self._update_start = time.perf_counter()
                return self._rows(self._batch_rows(trajs, []), picks, [], offset)   # the forks' returns: _land
            branches = self._branch(trajs, points, seed)                        # K branches from each
        except BaseException:
            self._branching.close()   # (waits for branches still running: their sandboxes close)
            raise
        self._branching.close()
        out = finish(branches)
        self._update_start = time.perf_counter()
        return out

    def _finish(self, step: int, offset: int, result: RolloutResult, picks: dict, reused: int,
                branches: list[Branch]) -> dict:
        """The rows and what the iteration keeps, once its branches have ended."""
        if self.verdicts is not None:
            self.ledger.add("verdicts_reused", self.verdicts.reused - reused)
        batch = self._batch_rows(result.trajectories, branches)
        out = self._rows(batch, picks, branches, offset)                        # TRL's rows, credit records
        self._keep(step, offset, result, picks, branches, batch, out)
        return out

    def _land(self) -> list[dict]:
        """The credit records of the rows whose branches ran beside the update (`_rollout`), once they have
        ended: the seconds waited for them are theirs, not the update's (Ledger.beside)."""
        (finish, before, branching), self._late = self._late, None
        start = time.perf_counter()
        self._branching.close()   # the branches, then the policy's generation context
        waited = time.perf_counter() - start
        self._update_start += waited
        self.ledger.beside(before, waited)
        return finish(branching.result())["crr_credit"]

    def _batch(self, prompts: list[str]) -> tuple[int, int, list[Task], int]:
        """(update step, iteration seed, tasks, global index of the first task) of this process's prompts,
        which TRL gives as whole groups: each task's prompt G times."""
        G, step, rank = self.num_generations, self.state.global_step, self.accelerator.process_index
        # process 0 (the only one of a plain run) draws from (seed, step); process r > 0 from (seed, step, r)
        seed = derive_seed(self.cfg.seed, step, *([rank] if rank else []))
        if len(prompts) % G or any(p != prompts[i - i % G] for i, p in enumerate(prompts)):
            raise CRRError(f"this process got {len(prompts)} prompts that are not whole groups of G={G}")
        tasks = [self.tasks[p] for p in prompts[::G]]
        return step, seed, tasks, rank * len(tasks)   # (this process's first task in the iteration)

    @contextmanager
    def _generating(self) -> Iterator[None]:
        """The policy in eval mode, with self.backend generating from it: the bare policy (the same module as the
        DDP-wrapped one's; under DeepSpeed ZeRO-3 its parameters gathered whole, so each process generates on
        its own, as TRL's own generation does)."""
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                         gather_deepspeed3_params=self.args.ds3_gather_for_generation) as model:
            was_training = model.training
            if self.backend is None:   # the live policy (LoRA weights update in place)
                self.backend = (TransformersBackend(model, self.processing_class, device=str(self.accelerator.device))
                                if self.cfg.backend == "transformers" else self._vllm_backend(model))
            model.eval()
            try:
                yield
            finally:
                model.train(was_training)

    def _sample(self, tasks: list[Task], seed: int, step: int) -> RolloutResult:
        """Algorithm 1, line 3: G on-policy trajectories per task, snapshotting every s_t (charged to fork_s);
        with live forks (cfg.live_forks) the method's forks start during it, as their states are realised."""
        cfg = self.cfg
        self.live = LiveForks(**self._forking(seed), forks=cfg.forks, selector=cfg.selector, params=self._params(),
                              cf_samples=cfg.cf_samples, proposal=cfg.proposal, cf_temperature=cfg.cf_temperature,
                              horizon=cfg.horizon) if cfg.live_forks else None
        with self.ledger.phase("rollout_s"):
            if cfg.backend != "transformers":   # on-policy: vLLM samples from the last update's weights
                self._sync_weights(step)
            result = rollout(tasks, self.backend, self.engine, self.processing_class,
                             RolloutConfig(group_size=cfg.on_policy_group, seed=seed, workers=cfg.workers,
                                           episode=self.episode), pool=self.pool,
                             join=None if self.live is None else self.live.join, verdicts=self.verdicts)
        snapshot_s = sum((s.snapshot_ms or 0.0) for t in result.trajectories for s in t.steps) / 1e3
        self.ledger.move(snapshot_s, "rollout_s", "fork_s")
        if self.live is not None:
            self.live.charge(self.ledger, snapshot_s)
        return result

    def _forking(self, seed: int) -> dict:
        """What every fork of an iteration runs on; seed + 1 (and + 2, replay noise) are offsets, kept for the
        committed runs' draws (crr.seeds says why)."""
        return {"backend": self.backend, "engine": self.engine, "tokenizer": self.processing_class,
                "episode": self.episode, "seed": seed + 1, "pool": self.pool, "verdicts": self.verdicts}

    def _branch(self, trajs: list[Trajectory], picks: dict, seed: int) -> list[Branch]:
        """Algorithm 1, lines 5-9, the method's forks: K counterfactual branches of every picked step, or K
        on-policy continuations from every state (mc-values) or from the picked states (resets), or none; those
        the rollout started (live forks) or, after it, all of them."""
        cfg = self.cfg
        if self.live is not None:
            return self.live.branches(continuation_points(trajs) if cfg.forks == "continuation" else picks)
        # injected replay noise rho draws from this iteration's realised outputs (none to gather at rho = 0)
        noise = RerunOutputs(trajs, cfg.replay_noise, seed + 2) if cfg.replay_noise else None
        # a branch a sibling played is that sibling's row: no row of its own for a method that trains on branches
        forking = {**self._forking(seed), "ledger": self.ledger, "noise": noise,
                   "reuse_played": cfg.reuse_played and not cfg.row.swaps and cfg.forks != "reset"}
        if cfg.forks == "counterfactual":
            return run_branches(trajs, picks, cf_samples=cfg.cf_samples, proposal=cfg.proposal,
                                cf_temperature=cfg.cf_temperature, horizon=cfg.horizon, **forking)
        if cfg.forks in ("continuation", "reset"):
            points = continuation_points(trajs) if cfg.forks == "continuation" else picks
            return continuations(trajs, points, samples=cfg.cf_samples, **forking)
        return []

    def _keep(self, step: int, offset: int, result: RolloutResult, picks: dict, branches: list[Branch],
              batch: list[tuple[int | None, Trajectory, int]], out: dict) -> None:
        """What an iteration leaves: its tuples/ part, its trajectory records (keep_trajectories; written with
        the advantages; a resets method's records are its rows, the restart rows among them) and its
        statistics; the snapshots are freed."""
        trajs = result.trajectories
        tuples = [self._tuple(trajs[b.row], b, step, offset) for b in branches if b.sample is not None]
        self.records = None
        if self.cfg.keep_trajectories:   # by row: a resets method's restarts are rows, not branches of one
            row_picks = {r: picks[i] for r, (i, _, _) in enumerate(batch) if i in picks}
            forked = [] if self.cfg.forks == "reset" else branches
            self.records = records.collect([traj for _, traj, _ in batch], forked, out, row_picks,
                                           [start for _, _, start in batch])
        result.release()
        shared = self._gather_iteration(trajs, picks, branches, tuples)
        if self.accelerator.is_main_process:
            write_part(self.run.path, step, shared["tuples"])
        self._record_iteration(shared)

    def _vllm_backend(self, model):
        """A VLLMBackend on the live policy: vLLM loads the model directory, then gets the policy's
        (merged, under LoRA) weights before every rollout. On CPU its engine runs in this process
        (VLLM_ENABLE_V1_MULTIPROCESSING=0, unless set: an engine process would be spawned from a trainer
        that need not be under a __main__ guard) and without torch.compile (enforce_eager: faster start)."""
        import os

        from crr.policy.backend import VLLMBackend

        device = str(self.accelerator.device)
        if self.cfg.backend == SERVER_BACKEND:
            return self._server_backend(model, device)
        kwargs = {"enforce_eager": True} if device == "cpu" else {}
        if device == "cpu":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        log.info("generation on vLLM from %s (device %s)", resolve_model(self.cfg), device)
        return VLLMBackend(model, self.processing_class, model_path=resolve_model(self.cfg), device=device, **kwargs)

    def _server_backend(self, model, device: str):
        """A VLLMServerBackend against cfg.vllm_server (TRL's server mode), which must run crr's grammar
        processor and serve the trained model (its weights are replaced by the policy's before every
        rollout). Untested: it needs a CUDA trainer (CRRConfig refuses it on CPU)."""
        from crr.policy.backend import VLLMServerBackend, check_served_model, probe_vllm_server

        url = self.cfg.vllm_server
        check_served_model(probe_vllm_server(url, timeout=self.cfg.vllm_server_timeout), resolve_model(self.cfg), url)
        log.info("generation on the vLLM server at %s (device %s)", url, device)
        return VLLMServerBackend(model, self.processing_class, base_url=url, device=device,
                                 connection_timeout=self.cfg.vllm_server_timeout)

    def _sync_weights(self, step: int) -> None:
        start = time.perf_counter()
        if self.cfg.backend != SERVER_BACKEND:
            self.backend.sync_weights()
        else:   # one server: the main process pushes (every process holds the same weights), the others wait
            if is_main():
                self.backend.sync_weights()
            else:
                self.backend.behaviour_gap = 0.0
            barrier()
        self.weight_syncs += 1
        log.info("update %d: policy weights synced into vLLM (%d syncs, %.2fs)", step, self.weight_syncs,
                 time.perf_counter() - start)

    def _params(self) -> SelectorParams:
        return SelectorParams(k=self.cfg.k, eta=self.cfg.eta, lambda_type=self.cfg.lambda_type)

    def _select(self, trajs: list[Trajectory], seed: int) -> dict:
        params = self._params()
        rng = np.random.default_rng(seed)
        values = sibling_values([state_keys(t.steps) for t in trajs], [t.reward for t in trajs],
                                [t.task_index for t in trajs]) if self.cfg.state_keys else None
        return select_each(self.cfg.selector, trajs, params, rng, values)

    def _batch_rows(self, trajs: list[Trajectory], branches: list[Branch]) -> list[tuple[int | None, Trajectory, int]]:
        """The batch's rows in TRL's order as (on-policy index or None, trajectory, the first step it sampled): the
        on-policy trajectories, and for method resets, after each task's, its M restart rows: the continuations of
        its reset state, numbered as the task's next siblings. A restart that was not played (its fork failed,
        or the task had no state to reset from) is an excluded row: a copy of the task's first trajectory with no
        return."""
        if self.cfg.forks != "reset":
            return [(i, traj, 0) for i, traj in enumerate(trajs)]
        out: list[tuple[int | None, Trajectory, int]] = []
        for task in dict.fromkeys(t.task_index for t in trajs):
            mine = [i for i, t in enumerate(trajs) if t.task_index == task]
            restarts = [b for b in branches if trajs[b.row].task_index == task]
            out += [(i, trajs[i], 0) for i in mine]
            for j in range(self.cfg.cf_samples):
                b = restarts[j] if j < len(restarts) else None
                if b is None or b.traj is None or len(b.traj.steps) <= b.t:   # (a_t~ not played: an infra failure)
                    error = "no state to reset from" if b is None else b.error or getattr(b.traj, "infra_error", None)
                    row, start = dataclasses.replace(trajs[mine[0]], reward=None, infra_error=f"restart: {error}"), 0
                else:
                    row, start = b.traj, b.t
                out.append((None, dataclasses.replace(row, sibling=len(mine) + j), start))
        return out

    def _rows(self, batch: list[tuple[int | None, Trajectory, int]], picks: dict, branches: list[Branch],
              offset: int = 0) -> dict:
        """TRL's rows (`_batch_rows`), each with the same credit record whatever the method: the selected steps
        and the scored returns of its forks (counterfactuals or continuations), its state keys, the step it was
        reset to. A row swapped for a branch (Search-Select) is that branch's trajectory: the realised one's picks
        and forks are not its. A restart row's steps before its reset (a failed sibling's) are masked from the
        loss, as observations are (env_mask)."""
        cfg = self.cfg
        out = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward", "policy_logprobs",
                               "crr_credit")}
        self.replaced = 0
        for i, traj, reset in batch:
            mine = [b for b in branches if b.row == i]
            j = search_select_choice(traj.reward, [b.reward for b in mine]) if cfg.row.swaps else None
            if j is not None:
                traj, self.replaced, mine = mine[j].traj, self.replaced + 1, []
            row = traj.trl_row()
            if reset:
                start = row["step_spans"][reset][0]
                row["env_mask"] = [0] * start + row["env_mask"][start:]
            returns: dict[int, list[float]] = {}
            for b in mine:
                if b.reward is not None:
                    returns.setdefault(b.t, []).append(b.reward)
            credit = RowCredit(group_key=offset + traj.task_index, reward=traj.reward, spans=row["step_spans"],
                               selected=[s.t for s in picks.get(i, [])] if j is None else [],
                               counterfactuals=returns if cfg.forks == "counterfactual" else {},
                               state_keys=state_keys(traj.steps),
                               continuations=returns if cfg.forks == "continuation" else {}, reset=reset)
            for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward"):
                out[key].append(row[key])
            out["policy_logprobs"].append([lp for s in traj.steps
                                           for lp in s.policy_logprobs + [0.0] * len(s.observation_ids)])
            out["crr_credit"].append(dataclasses.asdict(credit))
        return out

    def _tuple(self, traj: Trajectory, b: Branch, step: int, offset: int = 0) -> dict:
        snap = traj.snapshots.get(b.t)
        branch_steps = b.traj.steps[b.t:] if b.traj is not None else []
        return {"task_id": traj.task_id, "policy_seed": self.cfg.seed, "policy_version": step, "iteration": step,
                "row": (offset + traj.task_index) * self.num_generations + traj.sibling, "t": b.t,
                "steps": len(traj.steps),
                "snapshot_id": None if snap is None else snap.id, "realised_action": traj.steps[b.t].action,
                "counterfactual_action": b.sample.text, "prefix_actions": [s.action for s in traj.steps[:b.t]],
                "realised_suffix": [s.action for s in traj.steps[b.t:]],
                "counterfactual_suffix": [s.action for s in branch_steps] or [b.sample.text],
                "reward": traj.reward, "cf_reward": b.reward,
                "cf_end_reason": None if b.traj is None else b.traj.end_reason,
                "cf_infra_error": b.error if b.traj is None else b.traj.infra_error,
                "proposal_logprob": b.sample.proposal_logprob, "selector_score": b.selection.score,
                "k_index": b.k_index, "prefix_signature": prefix_signature([s.call for s in traj.steps[:b.t]])}

    def _gather_iteration(self, trajs: list[Trajectory], picks: dict, branches: list[Branch],
                          tuples: list[dict]) -> dict:
        """What the iteration's record needs of this process's trajectories, branches and tuples, joined
        with every other process's in process order (the batch's row order); the ledger counts stay local
        until the iteration ends (Ledger.end merges them)."""
        led = self.ledger
        on_policy = sum(t.generated_tokens for t in trajs)
        discarded = [] if self.live is None else self.live.discarded   # live forks that were not picked
        led.add("trajectories", len(trajs))
        led.add("generated_tokens_on_policy", on_policy)
        led.add("generated_tokens_all", on_policy + sum(b.tokens for b in branches + discarded))
        observed = sum(map(len, {tuple(t.prompt_ids) for t in trajs})) + sum(t.observed_tokens for t in trajs)
        led.add("observed_tokens_on_policy", observed)
        led.add("observed_tokens_all", observed + sum(b.observed_tokens for b in branches + discarded))
        led.add("effective_tokens", sum(t.generated_tokens for t in trajs if t.reward is not None))
        led.add("forks", sum(b.sample is not None for b in branches))
        led.add("forks_discarded", sum(b.sample is not None for b in discarded))
        led.add("forks_reused", sum(b.played_by is not None for b in branches))
        led.add("harness_tampered", sum(bool(t.harness_files) for t in trajs))
        mine = {"trajs": [(t.task_id, t.reward, len(t.steps)) for t in trajs],
                "picks": [len(v) for v in picks.values()],
                "branches": [(b.sample is not None, b.reward) for b in branches],
                "replaced": [getattr(self, "replaced", 0)],
                "noise": [(sum(s.resampled for s in b.traj.steps[b.t:]), len(b.traj.steps) - b.t)
                          for b in branches if b.traj],
                "tuples": tuples}
        every = gather_one(mine)
        return {k: [x for part in every for x in part[k]] for k in mine}

    def _record_iteration(self, shared: dict) -> None:
        trajs, picks, branches, tuples = shared["trajs"], shared["picks"], shared["branches"], shared["tuples"]
        scored = [r for _, r, _ in trajs if r is not None]
        cf = [r for _, r in branches if r is not None]
        self.iteration = {
            "reward_mean": float(np.mean(scored)) if scored else None, "scored": len(scored),
            "group_rewards": {tid: [r for other, r, _ in trajs if other == tid] for tid, _, _ in trajs},
            "infra_errors": len(trajs) - len(scored), "mean_turns": float(np.mean([n for _, _, n in trajs])),
            "selected": sum(picks), "selector_hits": sum(bool(n) for n in picks),
            "branches": len(branches), "proposal_skips": sum(not sampled for sampled, _ in branches),
            "branch_infra_errors": sum(sampled and r is None for sampled, r in branches),
            "cf_reward_mean": float(np.mean(cf)) if cf else None,
            "replaced": sum(shared["replaced"]) if self.cfg.row.swaps else None,
            "replay_noise_injected": sum(n for n, _ in shared["noise"]),
            "replay_noise_steps": sum(n for _, n in shared["noise"]),
            "covariance": bucket_covariance(pd.DataFrame(tuples)) if tuples else None,
            "outcome_pairs": records.outcome_pairs([(t["reward"], t["cf_reward"]) for t in tuples]),
        }
        if self.cfg.backend != "transformers":   # syncs so far; |vLLM - policy| behaviour log-prob since the last sync
            self.iteration.update({"vllm_weight_syncs": self.weight_syncs,
                                   "vllm_behaviour_gap": max(gather_one(self.backend.behaviour_gap))})

    # ------------------------------------------------------------------ 2. (B, T) advantages
    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        try:
            out = super()._generate_and_score_completions(inputs)
        except BaseException:
            self._abandon()
            raise
        B, T = out["completion_ids"].shape
        # rows with no return (an infrastructure failure) are out of the loss entirely, before its forward pass
        scored = torch.tensor([x["reward"] is not None for x in inputs], device=out["completion_mask"].device)
        out["completion_mask"] = out["completion_mask"] * scored.unsqueeze(1).to(out["completion_mask"].dtype)
        if self._late is not None:   # the branches still run: the advantages follow the loss's forward pass
            out["advantages"] = torch.zeros(B, T, device=out["completion_ids"].device)
            out["crr_row"] = torch.arange(B, device=out["completion_ids"].device)   # (TRL shuffles the rows)
            return out
        out["advantages"] = self._advantages([x["crr_credit"] for x in inputs], T).to(out["completion_ids"].device)
        if self.cfg.row.swaps:   # ratio against the behaviour policy that generated each row
            old = torch.zeros(B, T, device=out["completion_ids"].device)
            for i, x in enumerate(inputs):
                lps = x["policy_logprobs"][:T]
                old[i, :len(lps)] = torch.tensor(lps)
            out["old_per_token_logps"] = old
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **rest):
        """TRL's, with each distinct prompt of a chunk encoded once (crr.train.shared_prompt; TRL's own pass for
        rows with images or an auxiliary loss, or nothing to share); and after the loss's forward pass (the one
        with gradients) of an update whose branches ran beside it: the wait for them, then their advantages in
        every chunk of the update's rows, which TRL reads next (`_rollout`)."""
        shared = None   # (one process: DDP's reducer expects one forward pass per backward)
        if self.accelerator.num_processes == 1 and not compute_aux_loss and all(v is None for v in rest.values()):
            with self.accelerator.autocast():
                shared = shared_prompt_logps(model, input_ids, attention_mask, logits_to_keep,
                                             batch_size or input_ids.size(0), compute_entropy)
        out = (*shared, None) if shared is not None else super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **rest)
        if self._late is not None and torch.is_grad_enabled():
            first = self._buffered_inputs[0]
            advantages = self._advantages(self._land(), first["advantages"].shape[1]).to(first["advantages"].device)
            for chunk in self._buffered_inputs:
                chunk["advantages"] = advantages[chunk["crr_row"]]
        return out

    def training_step(self, *args, **kwargs):
        try:
            return super().training_step(*args, **kwargs)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """After a failure: wait for branches still running beside the update (their sandboxes close)."""
        self._late = None
        self._branching.close()

    def _advantages(self, credit: list[dict], T: int) -> torch.Tensor:
        """Algorithm 1, line 10: this process's (B, T) advantages from its rows' credit records, by the config's
        estimator; the update's trajectory records and advantage statistics."""
        local = [RowCredit(**{**x, "spans": [tuple(s) for s in x["spans"]]}) for x in credit]
        # as TRL does with its rewards: the whole batch's rows (every process's; groups carry global ids),
        # advantages within complete groups, then this process's slice (the batches are equal in size)
        rows = gather(local)
        every_adv = estimate(self.cfg.estimator, rows, **self.cfg.advantage_params)
        start = self.accelerator.process_index * len(local)
        step_adv = every_adv[start:start + len(local)]
        if any((a is None) != (r.reward is None) for r, a in zip(local, step_adv)):
            raise CRRError(f"the advantage estimator {self.cfg.estimator!r} excluded a scored row or scored an "
                           "unscored one; an estimator returns None exactly for the rows with no reward")
        if self.records is not None:   # every process's trajectories and branches, with these advantages
            parts = gather_one(self.records)
            if self.accelerator.is_main_process:
                records.write_update(self.run.path, self.state.global_step, parts, rows, every_adv)
        flat = [a for adv in every_adv if adv is not None for a in adv]
        # a swapping method's forks replace rows (its estimator is GRPO's): they are not contrasts
        selected = [adv[t] for r, adv in zip(rows, every_adv) if adv is not None for t in r.selected
                    if r.counterfactuals.get(t)] if not self.cfg.row.swaps else []
        self.iteration.update({
            "adv_mean": float(np.mean(flat)) if flat else None, "adv_std": float(np.std(flat)) if flat else None,
            "adv_nonzero": float(np.mean([a != 0 for a in flat])) if flat else None,
            "contrast_mean": float(np.mean(selected)) if selected else None, "contrasts": len(selected),
            "advantage_snr": advantage_snr([a for a in every_adv if a is not None])})
        if any(r.state_keys for r in rows):
            self.iteration.update(step_group_counts(rows))
        return token_advantages(local, step_adv, T)

    # ------------------------------------------------------------------ 3. checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        """Transformers writes checkpoint-N in place, so an interrupted save leaves a torn checkpoint that looks
        like the newest. Here every process writes its part into checkpoints/.staging/checkpoint-N, and the
        main process then renames it into place whole (crr.sandbox.checkout.publish): complete or absent."""
        final = Path(self.args.output_dir)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = final / STAGING
        self.args.output_dir = str(staging)
        try:
            super()._save_checkpoint(model, trial)
        except SAVE_ERRORS as e:
            error = save_failed(final / name, self.run.path, e)   # (the space left before the part saved is freed)
            shutil.rmtree(staging, ignore_errors=True)
            raise error from None
        finally:
            self.args.output_dir = str(final)
        barrier()   # every process's part (its RNG state) is written
        if self.accelerator.is_main_process:
            publish(staging / name, final / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(output_dir=str(final), save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        barrier()


def budget_allows_next(iteration_s: list[float], budget_s: float) -> bool:
    """Whether one more iteration fits a wall-clock budget: the ledger wall clock so far (the sum of the
    finished iterations' `iteration_s`) plus the running mean of an iteration stays at or below `budget_s`. An
    equal-wall-clock run so stops at or below its budget (unless its last iteration runs longer than the mean of
    those before), where stopping once the budget is passed overshot it by part of an update."""
    if not iteration_s:
        return True
    return sum(iteration_s) + sum(iteration_s) / len(iteration_s) <= budget_s


def step_group_counts(rows: list[RowCredit]) -> dict:
    """How often GiGPO's step groups form (steps of the siblings that share a state key): the groups of
    two or more steps, those past s_0 (every sibling starts in the same s_0), the share of steps in one."""
    groups = [m for m in state_groups(rows).values() if len(m) > 1]
    steps = sum(len(r.state_keys) for r in rows if r.reward is not None)
    return {"gigpo_groups": len(groups), "gigpo_groups_after_s0": sum(m[0][1] > 0 for m in groups),
            "gigpo_steps_grouped": sum(map(len, groups)) / steps if steps else None}


class _IterationCallback(TrainerCallback):
    """Closes each iteration: update time, ledger, metrics, checkpoints at budget fractions, budget stop.
    Every process takes the same decisions from the merged ledger; the main one writes and reports."""

    def __init__(self, trainer: CRRTrainer, on_iteration: Callable[[dict], None] | None):
        self.trainer, self.on_iteration = trainer, on_iteration

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer.accelerator.is_main_process:   # TRL's logs are already reduced over the processes
            self.trainer.run.log_metrics({"event": "trl", "step": state.global_step,
                                          **{k: v for k, v in (logs or {}).items() if not k.startswith("crr/")}})

    def on_step_end(self, args, state, control, **kwargs):
        tr, cfg = self.trainer, self.trainer.cfg
        led = tr.ledger
        led.current["update_s"] += time.perf_counter() - tr._update_start
        led.add("updates", 1)
        it = led.end(combine=lambda mine: merge(gather_one(mine)))
        record = {"event": "iteration", "step": state.global_step, **tr.iteration,
                  # fork/materialisation alone, and everything counterfactual (fork + rollout + tests)
                  "fork_share": it["fork_s"] / it["wall_s"] if it["wall_s"] else 0.0,
                  "cf_share": ((it["fork_s"] + it["cf_rollout_s"] + it["cf_test_s"]) / it["wall_s"]
                               if it["wall_s"] else 0.0),
                  "ledger": {k: it[k] for k in it if k != "iteration"}}
        if state.global_step % cfg.diagnostics_every:
            record.pop("advantage_snr"), record.pop("covariance")
        for key, value in records.tracker_scalars(record).items():   # TRL's next log: every report_to gets them
            tr._metrics["train"][key].append(value)
        if tr.accelerator.is_main_process:
            tr.run.log_metrics(record)
            if self.on_iteration is not None:
                self.on_iteration({**record, "max_steps": state.max_steps, "cumulative": led.cumulative})
        wall_h = led.cumulative["wall_s"] / 3600
        marks = {max(1, math.ceil(f * state.max_steps)) for f in cfg.checkpoint_fractions}
        if cfg.budget_hours is not None:
            before = (led.cumulative["wall_s"] - it["wall_s"]) / 3600
            crossed = any(before < f * cfg.budget_hours <= wall_h for f in cfg.checkpoint_fractions)
            if not budget_allows_next([i["wall_s"] for i in led.iterations], cfg.budget_hours * 3600):
                control.should_training_stop = True
        else:
            crossed = False
        if (state.global_step % cfg.save_every == 0 or state.global_step in marks or crossed
                or control.should_training_stop or state.global_step >= state.max_steps):
            control.should_save = True
        return control


def start_run(cfg: CRRConfig, out: Path | str) -> RunDir:
    """A fresh run directory for `cfg`: made (and locked, and config.yaml written) by the main process; the
    other processes of a multi-process run get its path and never write it."""
    if cfg.agent_format is None:  # the format the model was trained with, recorded in the run's config
        cfg.agent_format = agent_record(resolve_model(cfg)).get("agent_format", "paper")
    run = None
    if is_main():
        run = RunDir.create("train", f"{cfg.method}-seed{cfg.seed}", root=out, seeds={"train": cfg.seed})
        cfg.output_dir = str(run.path / CHECKPOINTS)
        try:
            run.write_text("config.yaml", yaml.safe_dump(cfg.resolved(), sort_keys=False))
        except BaseException:
            run.discard()
            raise
    run = RunDir(Path(broadcast(None if run is None else str(run.path))))
    cfg.output_dir = str(run.path / CHECKPOINTS)
    return run


def checkpoint_gap(path: Path, optimizer: bool = True) -> str | None:
    """What the checkpoint directory `path` lacks to resume from (None: nothing); `optimizer`: whether the run
    saves the optimizer's state (not with save_only_model)."""
    if not (path / TRAINER_STATE).is_file():
        return f"no {TRAINER_STATE}"
    if optimizer and not (path / OPTIMIZER).is_file() and not (path / DEEPSPEED_LATEST).is_file():
        return f"no {OPTIMIZER}"
    if not any((path / w).is_file() for w in WEIGHTS) and not (path / DEEPSPEED_LATEST).is_file():
        return "no weights"
    return None


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint-N directory under `folder`, by step."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
             if p.is_dir() and (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", p.name))]
    return sorted(found)


def _after(record: dict, step: int) -> bool:
    """Whether a metrics.jsonl record belongs to an update after the first `step` (redone on resume)."""
    if record.get("event") == "ledger":   # the ledger numbers iterations from 0
        return record.get("iteration", -1) >= step
    return record.get("step", 0) > step   # iteration and TRL records: the update count after the update


def _changed(cfg: CRRConfig, run: RunDir, changes: dict, done: int) -> tuple[CRRConfig, dict]:
    """The run's config with `changes` applied, and {key: (was, now)}: settings equal to the run's are
    fine, RESUMABLE ones are applied, any other is a CRRError (nothing is written before)."""
    differ = {k: v for k, v in changes.items() if getattr(cfg, k) != v}
    fixed = [k for k in differ if k not in RESUMABLE]
    if fixed:
        raise CRRError(f"{run.path} was trained with {', '.join(f'{k}={getattr(cfg, k)!r}' for k in fixed)}, not "
                       f"{', '.join(f'{k}={differ[k]!r}' for k in fixed)}: a resumed run keeps its settings but "
                       f"{' and '.join(RESUMABLE)} (--max-updates, --budget-hours); drop the others, or start a "
                       "new run")
    if not differ:
        return cfg, {}
    new = load_config(run.path / "config.yaml", differ)
    new.output_dir = cfg.output_dir
    if "max_steps" in differ and new.max_steps != differ["max_steps"]:
        raise CRRError(f"max_steps={differ['max_steps']}: the run's max_trajectories={cfg.max_trajectories} caps it at "
                       f"{new.max_steps} updates")
    if 0 < new.max_steps < done:
        raise CRRError(f"max_steps={new.max_steps}: the run's checkpoint already holds {done} updates")
    return new, {k: (getattr(cfg, k), getattr(new, k)) for k in differ}


def resume_run(path: Path | str, changes: dict | None = None) -> tuple[CRRConfig, RunDir, str | None]:
    """The config, run directory and newest complete checkpoint of an interrupted run. An incomplete one (no
    trainer state, optimizer state or weights: a save interrupted before checkpoints were published whole,
    or one damaged since) is removed with a warning. metrics.jsonl, the ledger and the tuples are cut back to
    what the checkpoint holds, so that every update is recorded once (the ones after it are redone).
    `changes` (config keys; None or absent: the run's): RESUMABLE ones are applied, with a warning that says
    so, any other that differs from the run's is a CRRError before anything is written. Only the main
    process locks and rewrites the run; the others wait for it."""
    run = RunDir.open(path)
    if run.manifest.get("command") != "train":
        raise CRRError(f"{run.path} is a `crr {run.manifest.get('command')}` run, not a training run; --resume takes "
                       "a directory made by crr train")
    cfg = load_config(run.path / "config.yaml")   # (sets up the processes' group, which is_main() asks)
    cfg.output_dir = str(run.path / CHECKPOINTS)   # the run may have moved, or config.yaml holds a relative path
    torn, ckpt, done = [], None, 0
    for step, candidate in reversed(checkpoints(run.path / CHECKPOINTS)):
        gap = checkpoint_gap(candidate, optimizer=not cfg.save_only_model)
        if gap is None:
            ckpt, done = str(candidate), step
            break
        torn.append((candidate, gap))
    if torn and (run.path / "summary.json").is_file():
        # a finished run whose last checkpoints lack what a resume needs was copied without it (the committed
        # reference runs keep only trainer states, scripts/portable_results.py): a resume would redo its updates
        raise CRRError(f"{run.path} finished, and its checkpoints after {Path(ckpt).name if ckpt else 'the start'} "
                       f"cannot be resumed from ({torn[0][0].name}: {torn[0][1]}; a copy without its weights?): "
                       f"resuming would redo updates {done + 1}-{checkpoints(run.path / CHECKPOINTS)[-1][0]} and "
                       "replace their records; nothing was changed (to redo them, remove its summary.json)")
    cfg, changed = _changed(cfg, run, changes or {}, done)
    pending = [m for m in run.path.glob("eval-after/*/manifest.json") if not (m.parent / "summary.json").is_file()]
    if 0 < cfg.max_steps <= done and (run.path / "summary.json").is_file() and not pending:   # nothing left to do
        raise CRRError(f"{run.path} finished its {done} updates (max_steps={cfg.max_steps}); to train on, resume it "
                       f"with --max-updates above {done}; nothing was changed")
    if is_main():
        run.lock()
        # what is cut back is read first: a corrupt ledger or log refuses the resume before anything is written
        ledger, logged = Ledger(run, cfg.fork_cost_multiplier), run.records("metrics.jsonl")
        for candidate, gap in torn:
            log.warning("%s is incomplete (%s): removed, resuming from %s", candidate, gap,
                        Path(ckpt).name if ckpt else "the start")
            shutil.rmtree(candidate)
        shutil.rmtree(run.path / CHECKPOINTS / STAGING, ignore_errors=True)   # a save in flight when it stopped
        if changed:
            run.write_text("config.yaml", yaml.safe_dump(cfg.resolved(), sort_keys=False))
            log.warning("resuming with %s", ", ".join(f"{k}={now} (was {was})" for k, (was, now) in changed.items()))
        ledger.truncate(done)
        dropped = drop_parts_from(run.path, done)
        kept = [r for r in logged if not _after(r, done)]
        if len(kept) < len(logged):
            run.rewrite_records("metrics.jsonl", kept)
        run.log_metrics({"event": "resume", "checkpoint": ckpt, "from_step": done, "dropped_tuple_parts": dropped,
                         "dropped_record_parts": records.drop_records_from(run.path, done),
                         "dropped_metrics_records": len(logged) - len(kept),
                         "incomplete_checkpoints": {c.name: gap for c, gap in torn},
                         "changed": {k: list(v) for k, v in changed.items()}})
        log.info("resuming %s from %s", run.path, ckpt or "the start")
    barrier()   # the ledger is cut back before any process reads it
    cfg.model, cfg.tasks = as_made(run.path, cfg.model), as_made(run.path, cfg.tasks)   # not written back
    return cfg, run, ckpt


def train_tasks(cfg: CRRConfig) -> list[Task]:
    """The tasks a run trains on (the first n_tasks of cfg.tasks); a CRRError if they cannot fill an iteration."""
    tasks = load_tasks(cfg.tasks)[:cfg.n_tasks] if cfg.n_tasks else load_tasks(cfg.tasks)
    if len(tasks) < cfg.tasks_per_iteration:
        raise CRRError(f"{cfg.tasks} has {len(tasks)} tasks, fewer than tasks_per_iteration={cfg.tasks_per_iteration}")
    return tasks


def open_run(resume: Path | str | None = None, config: Path | str | None = None, overrides: list[str] | None = None,
             out: Path | str = "results/runs", **settings) -> tuple[CRRConfig, RunDir, str | None, list[Task]]:
    """`crr train`'s config, run directory, checkpoint to continue from and tasks: `resume_run(resume)` with the
    `overrides` and settings as its changes, or a new run of the preset `config` (None: experiments/cpu-crr.yaml)
    with the key=value `overrides`, then the given settings (None: not given) applied. Bad settings or tasks
    fail before a new run's directory is made."""
    given = {k: v for k, v in settings.items() if v is not None}
    if resume is not None:
        if config is not None:
            raise CRRError("--config with --resume: a resumed run keeps the config in its config.yaml; drop --config")
        cfg, run, checkpoint = resume_run(resume, {**parse_overrides(overrides or []), **given})
        return cfg, run, checkpoint, train_tasks(cfg)
    cfg = load_config(config, {**parse_overrides(overrides or []), **given, "output_dir": str(out)})
    tasks = train_tasks(cfg)
    return cfg, start_run(cfg, out), None, tasks


def update_rewards(run: RunDir) -> list[float]:
    """The mean training reward of each update so far (the reward curve)."""
    return [r["reward_mean"] for r in run.records("metrics.jsonl")
            if r.get("event") == "iteration" and r.get("reward_mean") is not None]


def train(cfg: CRRConfig, run: RunDir, checkpoint: str | None = None, *,
          on_iteration: Callable[[dict], None] | None = None, tasks: list[Task] | None = None) -> dict:
    """Train until max_steps / max_trajectories / budget_hours (on `tasks`, None: `train_tasks(cfg)`); returns
    the cumulative ledger and the path of the final adapter/model."""
    tasks = train_tasks(cfg) if tasks is None else tasks
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(resolve_model(cfg), dtype=cfg.dtype)
    with engine_spec_of(cfg).make() as engine:
        trainer = CRRTrainer(cfg, model, tokenizer, tasks, run, engine, on_iteration=on_iteration)
        try:
            state = checkpoint and TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_NAME))
            if state and state.global_step >= cfg.max_steps > 0:
                # The run holds all its updates (it stopped after its last checkpoint, or only its --eval after
                # training is left): TRL's loop would train one more before its stop check, so the checkpoint's
                # weights and state are loaded as its resume loads them (Trainer._load_from_checkpoint knows
                # every layout: a full model, a LoRA adapter, FSDP shards), and nothing is trained.
                trainer._load_from_checkpoint(checkpoint)
                trainer.state = state
            else:
                trainer.train(resume_from_checkpoint=checkpoint)
        finally:
            trainer.pool.close()
        final = run.path / "model"
        try:
            trainer.save_model(str(final))   # the main process's (TRL/transformers save on it only)
        except SAVE_ERRORS as e:
            raise save_failed(final, run.path, e) from None
        if is_main():
            write_agent_record(final, trainer.episode.agent_format, cfg.max_turns)
    summary = {"cumulative": trainer.ledger.cumulative, "updates": trainer.state.global_step, "model": str(final),
               "dtype": str(model.dtype).removeprefix("torch.")}
    if is_main():
        run.write_json("summary.json", summary)
    barrier()   # every process returns once the run directory is complete
    return summary
