# The two set-up commands of the README. Each runs scripts/setup.sh first (idempotent).
export HF_HUB_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1

.PHONY: main test

main:  ## the main job on the embedded default: CRR training, CPU preset (experiments/cpu-crr.yaml)
	scripts/setup.sh
	OMP_NUM_THREADS=1 .venv/bin/crr train

test:  ## the full test suite, Docker engine included
	scripts/setup.sh
	.venv/bin/python -m pytest -q -ra
