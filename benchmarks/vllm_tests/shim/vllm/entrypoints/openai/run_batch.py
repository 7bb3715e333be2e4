"""Stand-in for ``vllm.entrypoints.openai.run_batch``: ``python -m`` of it (and the ``vllm
run-batch`` command of shim/bin/vllm) runs ``hpu-serve run-batch`` with the embedded model
served under the test's model name; ``BatchRequestOutput`` is the answer line's schema as
vLLM's tests validate it."""

from __future__ import annotations

import os
import sys
from typing import Any

from pydantic import BaseModel

# embedding models, served by a stand-in embedder (last-token pooling)
EMBEDDING_MODELS = ("intfloat/multilingual-e5-small", "BAAI/bge-", "sentence-transformers/")


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str
    body: Any | None = None


class BatchRequestOutput(BaseModel):
    id: str
    custom_id: str
    response: BatchResponseData | None
    error: Any | None = None


def hpu_serve_args(argv: list[str]) -> list[str]:
    """``run-batch`` args of hpu-serve for vLLM's: ``--model NAME`` becomes the served name."""
    model, rest, it = None, [], iter(argv)
    for arg in it:
        if arg == "--model":
            model = next(it)
        elif arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    args = ["run-batch", *rest, "--seed", "0"]
    if model is not None:
        args += ["--served-model-name", model]
        if "reranker" in model:
            # a cross-encoder: a tiny random one of the same architecture (run.py lays it out)
            args += [os.environ["VLLM_SHIM_RERANKER"]]
        elif model.startswith(EMBEDDING_MODELS):
            # the embedded model is a GGUF file, which the pooling runner does not load: a
            # tiny random Llama (an HF folder run.py lays out) is the embedder instead
            args += [os.environ["VLLM_SHIM_EMBEDDER"], "--convert", "embed"]
    return args


def main(argv: list[str]) -> None:
    root = os.environ["HPU_SERVE_ROOT"]
    env = dict(os.environ, PYTHONPATH=root)
    os.chdir(root)
    os.execve(sys.executable, [sys.executable, "-m", "server", *hpu_serve_args(argv)], env)


if __name__ == "__main__":
    main(sys.argv[1:])
