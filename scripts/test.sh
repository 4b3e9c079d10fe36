#!/usr/bin/env bash
# Install (idempotent) everything the tests need, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# Two worker processes (pytest-xdist), one test file each at a time (module fixtures load once), one OpenMP thread
# each: on the 2-core machines the suite takes ~10 minutes instead of ~17. FASTDLLM_TEST_WORKERS=0 runs it in one process.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q -ra --durations=15 -n "${FASTDLLM_TEST_WORKERS:-2}" --dist loadfile "$@"
