#!/usr/bin/env bash
# Optional peers for benchmarks/compare, in their own venv (.venv-peers): never test deps.
#   llama-cpp-python[server]  built from source by pip (a few minutes on 2 cores)
#   transformers[serving]     `transformers serve --continuous-batching`
#   llama-server              llama.cpp's own server, built with cmake from the llama.cpp
#                             sources vendored in llama-cpp-python's sdist (~10 minutes on
#                             2 cores) into .bench-cache/llama.cpp-build/bin
# Set SKIP_LLAMA_SERVER=1 to skip the last one.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-peers
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip install --disable-pip-version-check -q"
# CPU torch for transformers serve; never replace a vendor build already in that venv
"$VENV/bin/python" -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" $PIP "llama-cpp-python[server]"
$PIP "transformers[serving]" gguf accelerate

LLAMA_BUILD=.bench-cache/llama.cpp-build
if [ "${SKIP_LLAMA_SERVER:-0}" != 1 ] && [ ! -x "$LLAMA_BUILD/bin/llama-server" ]; then
    SRC=.bench-cache/src
    mkdir -p "$SRC"
    "$VENV/bin/pip" download --disable-pip-version-check -q --no-deps --no-binary :all: \
        "llama-cpp-python" -d "$SRC"
    tar xzf "$(ls -t "$SRC"/llama_cpp_python-*.tar.gz | head -1)" -C "$SRC"
    LLAMA_SRC="$(ls -dt "$SRC"/llama_cpp_python-*/vendor/llama.cpp | head -1)"
    cmake -S "$LLAMA_SRC" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > /dev/null
    cmake --build "$LLAMA_BUILD" --target llama-server -j "$(nproc)" > /dev/null
fi
echo "peers ready in $VENV; llama-server: $LLAMA_BUILD/bin/llama-server"
