"""The device-time ledger (paper: Appendix "Compute Accounting", Tables "supp-accounting" and
"supp-wallclock"; "Sensitivity to fork overhead").

Per iteration and cumulatively, in `ledger.json` (rewritten atomically) and one `ledger` record per
iteration in `metrics.jsonl`:

    rollout_s      on-policy rollout (generation, tool execution, verification of realised trajectories)
    fork_s         counterfactual fork/materialisation: snapshots of s_t, restores, and the (m - 1) x
                   surcharge of the fork-cost multiplier m, paid as a real delay
    cf_rollout_s   counterfactual rollout (proposal, on-policy continuation)
    cf_test_s      counterfactual tests (the verifier on each branch)
    update_s       learner update
  A method that forks on-policy continuations instead of counterfactuals (mc-values: Monte-Carlo values)
  charges them to the same three phases (fork_s, cf_rollout_s, cf_test_s), its continuations to `forks`
  and their tokens to generated_tokens_all, so its extra rollouts compare with CRR's one for one
  (the five are mutually exclusive: each second is charged to one phase), plus wall_s (the iteration's
  wall clock, which also holds what no phase claims), on-policy trajectories, updates, generated tokens
  on-policy and all (with counterfactual suffixes), observed tokens on-policy and all (what the policy read
  that it did not generate: each distinct task prompt once, since a task's siblings share it, and every
  observation it was fed; a branch's are those after its fork, its prefix being its parent's), effective
  tokens (loss-masked on-policy action tokens of the rows trained on), forks, forks_discarded (forks started
  during the rollout whose step the selector did not pick in the end: crr.train.counterfactual.LiveForks; their
  tokens are in generated_tokens_all),
  forks_reused (forks, counted in `forks`, whose alternative action a sibling had taken in the same state: the
  sibling's return is theirs and nothing was played, crr.train.counterfactual.played_by),
  harness_tampered (on-policy trajectories the verifier's harness audit
  scored 0 for changing the test harness: crr.agent.verifier.audit), verdicts_reused (episodes, on-policy
  or forked, that ended in a state an earlier episode of the run ended in and took its verdict instead of a
  test run: crr.agent.verdicts), and cf_beside_s: the seconds of counterfactual work that ran beside the learner
  update (branches_beside_update: crr.train.trainer; summed over processes, as the counts are), charged to no
  phase, since update_s holds them; the phases fork_s, cf_rollout_s and cf_test_s keep what that work added to
  the wall clock, the wait for it at its end (`beside`).

On resume the ledger is cut back to the iterations the checkpoint holds (`truncate`).

Across N processes (crr.train.distributed) every process keeps its own iteration record and `end`
combines them (`merge`): counts are summed (updates aside: the processes take each one together), each phase
is the mean over the processes (the seconds of the average device, so the phases still partition an
iteration), wall_s is the slowest process's, and the record says `processes: N` (absent: one process; device
time is wall_s x processes). Every process holds the merged ledger (budget stops agree); only the writer (the
main process) saves it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from crr.errors import CRRError
from crr.rundir import RunDir, read_run_mapping

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.json"
PHASES = ("rollout_s", "fork_s", "cf_rollout_s", "cf_test_s", "update_s")
CF_PHASES = ("fork_s", "cf_rollout_s", "cf_test_s")   # the counterfactual work
COUNTS = ("trajectories", "updates", "generated_tokens_on_policy", "generated_tokens_all", "observed_tokens_on_policy",
          "observed_tokens_all", "effective_tokens", "forks",
          "forks_discarded", "forks_reused", "harness_tampered", "verdicts_reused", "cf_beside_s")


class Ledger:
    def __init__(self, run: RunDir, fork_cost_multiplier: float = 1.0, *, writer: bool = True):
        if fork_cost_multiplier < 1:
            raise CRRError(f"the fork-cost multiplier m must be >= 1, got {fork_cost_multiplier}")
        self.run, self.m, self.writer = run, fork_cost_multiplier, writer
        path = run.path / LEDGER_FILE
        self.iterations: list[dict] = _read_iterations(path) if path.is_file() else []
        self.current: dict | None = None
        self._phase: str | None = None
        self._start = 0.0

    @property
    def cumulative(self) -> dict:
        keys = PHASES + ("wall_s",) + COUNTS
        return {k: sum(it.get(k, 0) for it in self.iterations) for k in keys}  # .get: ledgers from before a count

    def begin(self, iteration: int) -> None:
        self.current = {"iteration": iteration, **{k: 0.0 for k in PHASES}, "wall_s": 0.0, **{k: 0 for k in COUNTS}}
        self._start = time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the block's seconds to `name` (phases never nest: each second has one owner)."""
        if name not in PHASES:
            raise CRRError(f"unknown ledger phase {name!r}")
        if self._phase is not None:
            raise CRRError(f"ledger phase {name} started inside {self._phase}")
        self._phase, start = name, time.perf_counter()
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - start
            self._phase = None

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Re-attribute seconds measured inside one phase to another (snapshots taken during the rollout)."""
        self.current[src] -= seconds
        self.current[dst] += seconds

    def snapshot(self) -> dict:
        """The current iteration's counterfactual phases so far (for `beside`)."""
        return {k: self.current[k] for k in CF_PHASES}

    def beside(self, before: dict, waited: float) -> None:
        """Counterfactual work charged since `before` ran beside the learner update (its first passes), which
        waited `waited` seconds for it at the join: those seconds are what it added to the wall clock, so its
        phases keep them (each in proportion to its share); the rest, spent while the update ran (update_s),
        goes to cf_beside_s, outside the partition."""
        spent = {k: self.current[k] - before[k] for k in CF_PHASES}
        total = sum(spent.values())
        keep = min(waited / total, 1.0) if total > 0 else 1.0
        for k in CF_PHASES:
            self.current[k] -= spent[k] * (1 - keep)
        self.current["cf_beside_s"] += total * (1 - keep)

    def charge_fork_cost(self, measured_s: float) -> None:
        """The fork-cost multiplier: (m - 1) x the measured snapshot/restore/replay time, as a real delay."""
        delay = (self.m - 1.0) * measured_s
        if delay > 0:
            with self.phase("fork_s"):
                time.sleep(delay)

    def add(self, key: str, n: int) -> None:
        self.current[key] += n

    def end(self, combine: Callable[[dict], dict] | None = None) -> dict:
        """Close the iteration: record it (`combine`d with the other processes' records), rewrite
        ledger.json, log it to metrics.jsonl."""
        it = self.current
        it["wall_s"] = time.monotonic() - self._start
        if combine is not None:
            it = combine(it)
        self.iterations.append(it)
        self.current = None
        if self.writer:
            self.save()
            self.run.log_metrics({"event": "ledger", **it, "cumulative": self.cumulative})
        return it

    def truncate(self, iterations: int) -> None:
        """Keep the first `iterations` (what a checkpoint holds) and save."""
        self.iterations = [it for it in self.iterations if it["iteration"] < iterations]
        self.save()

    def save(self) -> None:
        if not self.writer:
            raise CRRError("this ledger is not its run's writer (only the main process writes the run)")
        self.run.write_json(LEDGER_FILE, {"fork_cost_multiplier": self.m, "phases": list(PHASES),
                                          "cumulative": self.cumulative, "iterations": self.iterations})


def _read_iterations(path) -> list[dict]:
    iterations = read_run_mapping(path).get("iterations")
    keys = {"iteration", "wall_s", *PHASES}   # not every count: a ledger from before a count was added still loads
    if not isinstance(iterations, list) or not all(isinstance(it, dict) and keys <= set(it) for it in iterations):
        raise CRRError(f"{path} is corrupt (no list of iteration records with {', '.join(sorted(keys))})")
    return iterations


def merge(records: list[dict]) -> dict:
    """One iteration's record from every process's (in process order): see the module docstring."""
    if len(records) == 1:
        return records[0]
    if len({r["iteration"] for r in records}) != 1:
        raise CRRError(f"processes closed different iterations: {[r['iteration'] for r in records]}")
    return {"iteration": records[0]["iteration"],
            **{k: sum(r[k] for r in records) / len(records) for k in PHASES},
            "wall_s": max(r["wall_s"] for r in records),
            **{k: sum(r.get(k, 0) for r in records) for k in COUNTS},
            "updates": max(r["updates"] for r in records),   # one optimizer update, taken by all together
            "processes": len(records)}
