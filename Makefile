# The two set-up commands of the README. Each runs scripts/setup.sh first (idempotent).
export HF_HUB_OFFLINE := 1
export TRL_EXPERIMENTAL_SILENCE := 1

.PHONY: main test

main:  ## the main job on the embedded default
	scripts/setup.sh
	.venv/bin/crr demo

test:  ## the full test suite, Docker engine included
	scripts/setup.sh
	.venv/bin/python -m pytest -q -ra
