# The two set-up commands of the README. Each runs scripts/setup.sh first (idempotent).
export HF_HUB_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1
# pytest-xdist workers of `make test` (tests/conftest.py says which tests share one)
TEST_WORKERS ?= 2

.PHONY: main test

main:  ## the main job: CRR from the shipped warm start on its learnable band (experiments/cpu-crr.yaml), held-out pass@1 before and after
	scripts/setup.sh
	OMP_NUM_THREADS=1 .venv/bin/crr train --eval nano-test2 --eval-n 64

test:  ## the full test suite, Docker engine included: on two workers, then the tests that must run alone
	scripts/setup.sh
	.venv/bin/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial"
	.venv/bin/python -m pytest -q -ra -m serial
