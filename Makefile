# The two set-up commands of the README. Each runs scripts/setup.sh first (idempotent).
export HF_HUB_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1

.PHONY: main test

main:  ## the main job: CRR from the shipped warm start on its learnable band (experiments/cpu-crr.yaml), held-out pass@1 before and after
	scripts/setup.sh
	OMP_NUM_THREADS=1 .venv/bin/crr train --eval nano-test --eval-n 64

test:  ## the full test suite, Docker engine included
	scripts/setup.sh
	.venv/bin/python -m pytest -q -ra
