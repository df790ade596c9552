"""Evaluation: greedy and sampled pass@k on a benchmark, SWE-bench predictions, the error taxonomy.

    from crr.eval import EvalConfig, benchmark, evaluate, resolve_policy, start_eval
"""

from crr.eval.evaluate import (
    EvalConfig,
    Policy,
    benchmark,
    evaluate,
    load_eval_policy,
    load_eval_tasks,
    open_eval,
    resolve_policy,
    result_record,
    resume_eval,
    start_eval,
    write_outputs,
)
from crr.eval.passk import KS, instance_counts, pass_at_k, summarise_samples
from crr.eval.taxonomy import ERROR_MODES, error_mode, held_out_counts, summarise_modes

__all__ = ["ERROR_MODES", "KS", "EvalConfig", "Policy", "benchmark", "error_mode", "evaluate",
           "held_out_counts", "instance_counts", "load_eval_policy", "load_eval_tasks", "open_eval", "pass_at_k",
           "resolve_policy", "result_record", "resume_eval", "start_eval", "summarise_modes", "summarise_samples",
           "write_outputs"]
