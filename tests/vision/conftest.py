"""Fixtures of the vision tests (the builders are in vision_helpers.py)."""

from __future__ import annotations

import pytest
from gemma3_helpers import save_tiny_gemma3
from vision_helpers import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object, object]:
    """(folder, HF LlavaForConditionalGeneration, its processor)."""
    path = tmp_path_factory.mktemp("tiny-llava")
    model, processor = save_tiny_llava(path)
    return str(path), model, processor


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object, object]:
    """(folder, HF Gemma3ForConditionalGeneration, its processor)."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model, processor = save_tiny_gemma3(path)
    return str(path), model, processor


@pytest.fixture(scope="session")
def tiny_qwen25vl(tmp_path_factory: pytest.TempPathFactory):
    """(folder, transformers' reference on the same weights)."""
    from qwen_helpers import save_tiny_qwen25vl

    path = tmp_path_factory.mktemp("tiny-qwen25vl")
    return str(path), save_tiny_qwen25vl(path)


@pytest.fixture(scope="session")
def tiny_llama4v(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object, object]:
    """(folder, HF Llama4ForConditionalGeneration, its tokenizer)."""
    from llama4_vision_helpers import save_tiny_llama4_vision

    path = tmp_path_factory.mktemp("tiny-llama4v")
    model, tokenizer = save_tiny_llama4_vision(path)
    return str(path), model, tokenizer
