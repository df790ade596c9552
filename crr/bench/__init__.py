"""crr's benchmarks, one module per thing measured, on the top layer (they drive any layer below):
crr.bench.fork (sandbox start, fork and restore: `crr sandbox bench`), crr.bench.filter (the determinism
filter's reruns: `crr filter bench`), crr.bench.rollout (`crr rollout bench`), crr.bench.tasks (`crr tasks bench`),
crr.bench.model (generation and the SFT step: `crr model bench`, `crr model sft-bench`) and crr.bench.vllm (the
vLLM backends)."""
