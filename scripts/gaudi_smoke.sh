#!/usr/bin/env bash
# Gaudi smoke test (see scripts/gaudi_smoke.py): serve the embedded model (and --model PATH if
# given), warm up, benchmark at concurrency 1 / 16 / 64, report, and fail if anything was
# compiled while serving. Runs in the environment the server runs in (the Gaudi image, or
# this checkout's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gaudi_smoke.py --python "$PY" "$@"
