#!/usr/bin/env bash
# Install (idempotent) and start the studio on the bundled model: http://127.0.0.1:7860
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python app.py "$@"
