#!/usr/bin/env bash
# Set up (idempotent) and serve the embedded default model (or whatever flags say).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev >&2
exec .venv/bin/bastion serve "$@"
