#!/usr/bin/env bash
# Optional peers for benchmarks/compare, in their own venv (.venv-peers): never test deps.
#   llama-cpp-python[server]  built from source by pip (a few minutes on 2 cores)
#   transformers[serving]     `transformers serve --continuous-batching`
# llama.cpp's own `llama-server` is used when it is on PATH (build it from llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-peers
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip install --disable-pip-version-check -q"
# CPU torch for transformers serve; never replace a vendor build already in that venv
"$VENV/bin/python" -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" $PIP "llama-cpp-python[server]"
$PIP "transformers[serving]" gguf accelerate
echo "peers ready in $VENV"
