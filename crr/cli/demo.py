"""`crr demo`: the environment demo (a scripted expert, two forks, A_t = R(tau) - R(tau~_t))."""

from __future__ import annotations

from pathlib import Path

from crr.cli.common import (console, engine_opt_option, engine_option, friendly, mode_option, out_option,
                            ray_option, seed_option)


@friendly
def demo(
    engine: str = engine_option(),
    ray: str | None = ray_option(),
    engine_opt: list[str] = engine_opt_option(),
    mode: str | None = mode_option(help="Docker engine mode (docker, ray:docker): commit (default) or overlay."),
    seed: int = seed_option(help="Seed of the generated micro task."),
    out: Path = out_option(),
) -> None:
    """The environment demo: a scripted expert solves a generated micro task through the five tools;
    the sandbox is forked at two decision points, an alternative action is rolled forward in each
    fork, and the verifier scores both branches: A_t = R(tau) - R(tau~_t)."""
    from rich.table import Table

    from crr.demo import run_demo
    from crr.rundir import RunDir
    from crr.sandbox import engine_spec, parse_options
    from crr.tasks.micro import generate_micro

    spec = engine_spec(engine, parse_options(engine_opt or []), ray=ray, mode=mode)  # a bad setting fails here
    run = RunDir.create("demo", f"seed{seed}", root=out, seeds={"task": seed},
                        config={"engine": engine, "engine_options": spec.options, "mode": mode, "ray": ray,
                                "seed": seed})
    with console.status("generating a micro task (its FAIL_TO_PASS/PASS_TO_PASS come from real pytest runs)"):
        task = generate_micro(run.path / "tasks", n=1, seed=seed, split="train")[0]
    console.print(f"[bold]task[/] {task.instance_id}: {task.problem_statement.splitlines()[0]}")
    fork_engine = spec.make()
    try:
        with console.status(f"episode and forks on the {engine} engine"):
            result = run_demo(task, fork_engine, run)
    finally:
        fork_engine.close()

    def short(call: dict) -> str:
        args = call["arguments"]
        main = args.get("path") or args.get("command") or args.get("test_filter") or ""
        lines = f":{args['start']}-{args['end']}" if "start" in args and "end" in args else ""
        return f"{call['name']}({main}{lines})"

    steps = Table(title=f"realised trajectory tau  (R = {result.reward:g})")
    for col in ("t", "action", "type", "observation"):
        steps.add_column(col)
    for s in result.steps:
        steps.add_row(str(s.t), short(s.call), "-" if s.tool_type is None else f"{s.tool_type:g}",
                      s.observation.strip().splitlines()[0][:60] if s.observation.strip() else "")
    console.print(steps)
    forks = Table(title="counterfactual forks: A_t = R(tau) - R(tau~_t)")
    for col in ("t", "a_t", "a~_t", "R(tau)", "R(tau~)", "A_t", "snap ms", "restore ms"):
        forks.add_column(col)
    for f in result.forks:
        fmt = lambda v: "infra" if v is None else f"{v:g}"  # noqa: E731
        forks.add_row(str(f.t), short(f.realised), short(f.counterfactual),
                      fmt(f.r_realised), fmt(f.r_counterfactual), fmt(f.advantage),
                      f"{f.snapshot_ms:.1f}", f"{f.restore_ms:.1f}")
    console.print(forks)
    console.print(f"run directory: {run.path}")
