"""`crr train` (GRPO, CRR, Search-Select on TRL) and `crr replay verify`.

torch and trl are imported inside the commands (through crr.train), never here.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from crr.cli.common import (_resume_with, console, emit_json, err_console, friendly, json_option, long_command,
                            out_option, progress_bar, seed_option)
from crr.errors import CRRError


@long_command
def train_command(
    overrides: list[str] = typer.Argument(None, help="Config overrides key=value (e.g. k=2 "
                                  "crr.cf_temperature=0.5; engine=ray:local ray=auto: sandboxes on a Ray cluster)."),
    method: str | None = typer.Option(None, "--method", help="A row of crr.train.config.METHODS: grpo | crr | "
                                      "search-select | gigpo | mc-values | resets (default: the config's)."),
    config: Path | None = typer.Option(None, "--config", help="A preset YAML (default: experiments/cpu-crr.yaml)."),
    seed: int | None = seed_option(None, help="Drives rollouts, selector, proposals and the learner."),
    out: Path = out_option(),
    max_trajectories: int | None = typer.Option(None, "--max-trajectories",
                                                help="Stop after N on-policy trajectories."),
    max_updates: int | None = typer.Option(None, "--max-updates", help="Stop after N optimizer updates."),
    budget_hours: float | None = typer.Option(None, "--budget-hours", help="Stop before an update that would take "
                                              "the ledger wall clock past H hours (at the mean update time)."),
    resume: Path | None = typer.Option(None, "--resume", help="Continue a run directory from its last complete "
                                       "checkpoint; of its settings only --max-updates and --budget-hours may change."),
    eval_tasks: str | None = typer.Option(None, "--eval", help="Held-out tasks (e.g. nano-test) on which the "
                                          "starting and the trained policy are evaluated greedily (pass@1 before "
                                          "and after, in the run's eval-before/ and eval-after/)."),
    eval_n: int | None = typer.Option(None, "--eval-n", help="With --eval: the first N tasks (default all)."),
) -> None:
    """Train with GRPO, CRR (hybrid advantages from forked counterfactuals) or Search-Select; writes a run
    directory with config.yaml, manifest.json, metrics.jsonl, ledger.json, tuples/ and checkpoints/."""
    from crr.train.distributed import is_main, launched_processes
    from crr.train.trainer import open_run, resolve_model, train, update_rewards

    if eval_n is not None and eval_tasks is None and resume is None:
        raise CRRError("--eval-n is the size of --eval's task set; give --eval too")
    if resume is not None:   # a run started with --eval resumes with it, as its eval-before/ records it
        eval_tasks, eval_n = _resumed_eval(Path(resume), eval_tasks, eval_n)
    if eval_tasks is not None and launched_processes() > 1:
        raise CRRError("--eval runs in one process: train across processes without it, then `crr eval` the run"
                       + (" (this run was started with --eval: resume it in one process)" if resume else ""))
    if eval_tasks is not None and resume is None:
        _check_eval(eval_tasks, eval_n)
    cfg, run, checkpoint, tasks = open_run(resume, config, overrides, out, method=method, seed=seed,
                                           max_trajectories=max_trajectories, max_steps=max_updates,
                                           budget_hours=budget_hours)
    _resume_train(run.path, eval_tasks, eval_n)
    err_console.print(f"run directory: {run.path}", highlight=False)
    if eval_tasks is not None:
        before = _held_out_pass(eval_tasks, eval_n, cfg, run, "before", model=resolve_model(cfg))
    progress = progress_bar("train", "updates", disable=not is_main())
    bar = progress.add_task("train", total=None)

    def update(r: dict) -> None:
        console.print(_iteration_line(r), highlight=False, soft_wrap=True)
        progress.update(bar, completed=r["step"], total=r["max_steps"])

    with progress:
        summary = train(cfg, run, checkpoint, on_iteration=update, tasks=tasks)
    if not is_main():   # across processes (accelerate launch) the main one reports
        return
    c = summary["cumulative"]
    console.print(f"done: {summary['updates']} updates, {c['trajectories']} trajectories, {c['forks']} forks, "
                  f"{c['wall_s']:.0f} s; model: {summary['model']}", highlight=False, soft_wrap=True)
    rewards = update_rewards(run)
    if rewards:
        quarter = max(1, len(rewards) // 4)
        console.print("training reward per update: " + " ".join(f"{v:.2f}" for v in rewards)
                      + f"\n  mean of the first {quarter}: {sum(rewards[:quarter]) / quarter:.2f}, "
                      f"of the last {quarter}: {sum(rewards[-quarter:]) / quarter:.2f}",
                      highlight=False, soft_wrap=True)
    if eval_tasks is not None:
        after = _held_out_pass(eval_tasks, eval_n, cfg, run, "after", run_dir=run.path)
        console.print(f"held-out pass@1 ({eval_tasks}, greedy): before [bold]{_pct(before)}[/] -> after "
                      f"[bold]{_pct(after)}[/]", highlight=False)


def _iteration_line(r: dict) -> str:
    """One line per update: reward, advantages, selection and forks, the ledger's time shares (cf: what the
    counterfactual work added to the clock; + the seconds it ran beside the update, which upd holds)."""
    led, cum = r["ledger"], r["cumulative"]
    fmt = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
    return (f"[bold]{r['step']}/{r['max_steps']}[/] R {fmt(r['reward_mean'])} | A {fmt(r['adv_mean'], '+.3f')}"
            f"±{fmt(r['adv_std'], '.3f')} nz {fmt(r['adv_nonzero'])} | sel {r['selected']} hits {r['selector_hits']}"
            f" forks {led['forks']} contrasts {r['contrasts']}"
            + (f" replaced {r['replaced']}" if r.get("replaced") is not None else "")
            + f" | fork share {r['fork_share']:.1%} cf share {r['cf_share']:.1%} | {led['wall_s']:.1f}s (roll "
            f"{led['rollout_s']:.1f} fork {led['fork_s']:.1f} cf {led['cf_rollout_s'] + led['cf_test_s']:.1f} "
            + (f"+ {led['cf_beside_s']:.1f} beside " if led.get("cf_beside_s") else "")
            + f"upd {led['update_s']:.1f}) | traj {cum['trajectories']} tok {cum['generated_tokens_all']}")


def _eval_source(tasks: str) -> tuple[str, str | None]:
    """`crr eval`'s (benchmark, FILE) for --eval's value: a named set, or a task file or directory."""
    from crr.eval.evaluate import ALIASES
    from crr.tasks.loaders import TASK_SETS

    return (tasks, None) if tasks in {**TASK_SETS, **ALIASES} else ("tasks", tasks)


def _check_eval(tasks: str, n: int | None) -> None:
    """Bad --eval tasks or --eval-n fail before the run directory is made."""
    from crr.eval.evaluate import benchmark
    from crr.tasks.loaders import load_tasks

    if n is not None and n < 1:
        raise CRRError(f"--eval-n must be at least 1, got {n}")
    _, source, adapter = benchmark(*_eval_source(tasks))
    load_tasks(source, adapter=adapter)


def _resume_train(run_path: Path, eval_tasks: str | None, eval_n: int | None) -> None:
    """Names the command that resumes this train run: with --eval (and --eval-n) until its eval-before/ holds the
    evaluation a resume learns them from."""
    told = ["--eval", eval_tasks, *(["--eval-n", str(eval_n)] if eval_n is not None else [])]
    needed = eval_tasks is not None and _earlier_eval(run_path, "before") is None
    _resume_with(shlex.join(["crr", "train", "--resume", str(run_path), *(told if needed else [])]))


def _earlier_eval(run_path: Path, when: str) -> Path | None:
    """The evaluation an interrupted train run started in eval-{when}/ (None: none was started)."""
    found = sorted((run_path / f"eval-{when}").glob("*/manifest.json"))
    return found[-1].parent if found else None


def _resumed_eval(run_path: Path, tasks: str | None, n: int | None) -> tuple[str | None, int | None]:
    """--eval and --eval-n of a resumed run: what it was started with (its eval-before/ evaluation's tasks),
    which a resume may restate but not change; none if it was started without --eval."""
    from crr.rundir import read_run_mapping

    earlier = _earlier_eval(run_path, "before")
    if earlier is None:
        return tasks, n
    config = read_run_mapping(earlier / "config.yaml", "YAML")
    started = (config["tasks"] if config.get("adapter") is None else config["dataset"], config.get("n_tasks"))
    if (tasks, n) not in ((None, None), started, (started[0], None)):
        raise CRRError(f"{run_path} was started with --eval {started[0]}"
                       + (f" --eval-n {started[1]}" if started[1] else "") + "; resume it with those or without --eval")
    return started


def _held_out_pass(tasks: str, n: int | None, cfg, run, when: str, model: str | None = None,
                   run_dir: Path | None = None) -> float | None:
    """Greedy pass@1 of the policy before or after training (a crr eval run directory inside the train run; one
    an interrupted run started is resumed)."""
    from crr.eval.evaluate import evaluate, open_eval

    dataset, file = _eval_source(tasks)
    earlier = _earlier_eval(run.path, when)
    if earlier is not None:
        config, eval_run = open_eval(None, resume=earlier)
    else:
        config, eval_run = open_eval(dataset, file, model=model, run_dir=run_dir, out=run.path / f"eval-{when}",
                                     n_tasks=n, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                                     engine=cfg.engine, engine_options=cfg.engine_options, ray=cfg.ray,
                                     mode=cfg.mode, agent_format=cfg.agent_format, workers=cfg.workers)
        _resume_train(run.path, tasks, n)   # the evaluation records --eval now
    with err_console.status(f"evaluating the policy {when} training on {tasks}"):
        summary = evaluate(config, eval_run)
    infra = f" ({summary['infra_errors']} infrastructure failures)" if summary["infra_errors"] else ""
    console.print(f"pass@1 {when} training ({config.dataset}, greedy, {summary['n_instances']} tasks): "
                  f"{_pct(summary['pass_at_1'])}{infra}", highlight=False)
    return summary["pass_at_1"]


def _pct(rate: float | None) -> str:
    """A pass rate; "-" where no sample was scored (every one an infrastructure failure)."""
    return "-" if rate is None else f"{rate:.1%}"


replay_app = typer.Typer(help="Replay recorded counterfactual tuples.", no_args_is_help=True)


@replay_app.command("verify")
@friendly
def replay_verify_command(
    run_dir: Path = typer.Argument(..., help="A `crr train` run directory with tuples/."),
    sample: int = typer.Option(10, "--sample", help="How many tuples to replay."),
    seed: int = seed_option(help="Which tuples are sampled."),
    as_json: bool = json_option("every replayed tuple"),
) -> None:
    """Re-execute sampled counterfactual suffixes from a fresh sandbox (prefix replayed) and report the
    fraction whose verifier returns reproduce."""
    from crr.train.replay_verify import replay_tuples

    if not 0 <= seed < 2 ** 32:   # the sampler's (numpy's) seed range
        raise CRRError(f"--seed must be between 0 and 2**32 - 1, got {seed}")
    result = replay_tuples(run_dir, sample, seed)
    if as_json:
        emit_json(result)
        return
    console.print(f"[bold]{result['reproduced']}/{result['sampled']}[/] replayed counterfactual returns reproduce "
                  f"({result['fraction']:.0%})", highlight=False)
