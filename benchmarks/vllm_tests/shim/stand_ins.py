"""Models the tests name that the shim can build in the same shape: each is served by a tiny
random checkpoint that run.py lays out in the staging tree (its folder in the environment
variable named here), instead of the embedded SmolLM2-135M-Instruct.

- ``hmellor/tiny-random-LlamaForCausalLM`` is itself a tiny random Llama with a long context
  (vLLM's basic tests start it with ``--max-model-len 10100``): the test suite's tiny Llama,
  its positions raised to Llama 3's 131072 (rotary: no table grows).
- ``HuggingFaceTB/SmolVLM-256M-Instruct``, a vision-language model: the test suite's tiny
  LLaVA (a CLIP tower, a projector and a Llama), the vision architecture hpu-serve serves.
  The tests that name it send an image and read the metrics, not the answer.
"""

from __future__ import annotations

import os

STAND_INS: dict[str, str] = {
    "hmellor/tiny-random-LlamaForCausalLM": "VLLM_SHIM_TINY_LLAMA",
    "HuggingFaceTB/SmolVLM-256M-Instruct": "VLLM_SHIM_VLM",
}


def folder_for(model: str) -> str | None:
    """The stand-in's folder for a model name, or None (the embedded model serves it)."""
    variable = STAND_INS.get(model)
    return os.environ.get(variable) if variable else None
