"""The policy: the embedded tiny default model (crr.policy.model), grammar-constrained tool-call generation
(crr.policy.backend, crr.policy.grammar), the SFT warm start (crr.policy.sft, crr.policy.sft_trainer).

Nothing is imported here, so that `crr.policy.model` and `crr.policy.sft_trainer` load with torch,
transformers and TRL alone (the SFT step can then run by itself on a GPU node)."""

# The generation backends (crr.policy.backend: TransformersBackend, VLLMBackend) by the names that
# `crr train`'s `backend=` and `crr eval --backend` take; here, not in crr.policy.backend, so that the
# configs that check a name need not import torch.
BACKENDS = ("transformers", "vllm")
