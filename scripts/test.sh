#!/usr/bin/env bash
# Install (idempotent) everything the tests need, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
