#!/usr/bin/env bash
# Set up (idempotent) and run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=12 "$@"
