"""The policy: the embedded tiny default model, grammar-constrained tool-call generation, per-step entropy."""

from crr.policy.backend import GenerationBackend, StepSample, TransformersBackend, VLLMBackend
from crr.policy.grammar import ToolCallGrammar, ToolCallMatcher
from crr.policy.model import default_model_dir, init_tiny_model, load_policy

__all__ = ["GenerationBackend", "StepSample", "ToolCallGrammar", "ToolCallMatcher", "TransformersBackend",
           "VLLMBackend", "default_model_dir", "init_tiny_model", "load_policy"]
