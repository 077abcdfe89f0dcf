#!/usr/bin/env bash
# scripts/kernel_resources.py compiled with the GPU host's Triton (3.6; this machine's venv has
# 3.9, which compiles some decode kernels differently: docs/BENCHMARKS.md, session 31). The
# wheel comes from the package index once, into the ignored .triton-host/; no GPU is needed.
#
#   bash scripts/kernel_resources_host.sh --order
set -eu
HOST_TRITON=${HOST_TRITON:-3.6.0}
DIR=.triton-host
PY=${PYTHON:-.venv/bin/python}
if ! PYTHONPATH=$DIR $PY -c "import triton, sys; sys.exit(triton.__version__ != '$HOST_TRITON')" \
    2>/dev/null; then
  $PY -m pip install -q --no-deps --upgrade --target "$DIR" "triton==$HOST_TRITON"
fi
PYTHONPATH=$DIR${PYTHONPATH:+:$PYTHONPATH} exec $PY scripts/kernel_resources.py "$@"
