"""The error-mode taxonomy (paper: Appendix "Error-Mode Taxonomy and Per-Mode Breakdown"): each failed
sample gets one dominant mode from a deterministic post-hoc classifier over the model patch, the gold
patch and the held-out tests' outcome (swebench's get_eval_tests_report of the verifier).

    mode = error_mode(reward, model_patch, task, report)   # None for a pass or an infra failure

The rules, first match wins:
  harness_subversion  the patch touches test or harness files: the static check of the patched files
                      against the exclusion list (crr.agent.verifier.harness_files_touched). The paper
                      counts such a patch as a failure even when the verifier passes it (`crr.agent.verifier.audit`
                      scores it 0 in every verification).
  wrong_localisation  the patch is empty or touches none of the gold patch's files: the defect is untouched.
  partial_fix         on the fix path and some FAIL_TO_PASS test passes, but not all of them, or a
                      PASS_TO_PASS test broke ("fixes the reported test but leaves a regression elsewhere").
  regression          a PASS_TO_PASS test broke and no FAIL_TO_PASS test passes: a new failure, no fix.
  other               none of these (e.g. the right file, but no held-out test changed outcome).
Harness subversion goes first because it changes the verifier's target, which makes the test outcome
the other rules read untrustworthy.
"""

from __future__ import annotations

from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS

from crr.agent.verifier import harness_files_touched, patch_paths
from crr.tasks.schema import Task

ERROR_MODES = ("wrong_localisation", "partial_fix", "regression", "harness_subversion", "other")


def held_out_counts(report: dict, task: Task) -> dict:
    """f2p_passed / f2p_total / p2p_failed / p2p_total from swebench's test report (all None when the
    tests did not run: an infra failure)."""
    if not report:
        return {"f2p_passed": None, "f2p_total": len(task.FAIL_TO_PASS),
                "p2p_failed": None, "p2p_total": len(task.PASS_TO_PASS)}
    return {"f2p_passed": len(report[FAIL_TO_PASS]["success"]), "f2p_total": len(task.FAIL_TO_PASS),
            "p2p_failed": len(report[PASS_TO_PASS]["failure"]), "p2p_total": len(task.PASS_TO_PASS)}


def error_mode(reward: float | None, model_patch: str, task: Task, report: dict) -> str | None:
    """The dominant error mode of a scored sample (module doc); None for a pass or an infra failure.
    `reward` is the audited one."""
    if reward is None or reward == 1.0:
        return None
    if harness_files_touched(model_patch, task):
        return "harness_subversion"
    if not model_patch.strip() or not set(patch_paths(model_patch)) & set(patch_paths(task.patch)):
        return "wrong_localisation"
    if not report:  # no test outcome to read (not a log the verifier graded)
        return "other"
    f2p_passed = len(report[FAIL_TO_PASS]["success"])
    p2p_broken = bool(report[PASS_TO_PASS]["failure"])
    if f2p_passed and (f2p_passed < len(task.FAIL_TO_PASS) or p2p_broken):
        return "partial_fix"
    if p2p_broken:
        return "regression"
    return "other"


def summarise_modes(records: list[dict]) -> dict:
    """{mode: {count, share, rate}}: share among the failed scored samples (the paper's conditional
    shares), rate among all scored samples (its approximate absolute rates); None without a denominator."""
    scored = [r for r in records if r["reward"] is not None]
    failed = [r for r in scored if r["reward"] != 1.0]
    out = {}
    for mode in ERROR_MODES:
        count = sum(r["error_mode"] == mode for r in failed)
        out[mode] = {"count": count, "share": count / len(failed) if failed else None,
                     "rate": count / len(scored) if scored else None}
    return out
