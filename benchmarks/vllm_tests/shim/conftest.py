"""Root conftest of the staging tree (in place of vLLM's tests/conftest.py, which needs vLLM):
the pytest-asyncio stand-in, a stand-in for the hub LoRA adapters the tests ask for, and the
not-applicable marks from known.py."""

from __future__ import annotations

import importlib

import known
import pytest
from tests.utils import UNAVAILABLE_LORA

if getattr(importlib.import_module("pytest_asyncio"), "STAND_IN", False):
    pytest_plugins = ["pytest_asyncio"]


def _unavailable_lora(repo_id: str) -> str:
    """The adapter in the embedded model's shape that run.py laid out (for the files that
    use hub adapters), else a path the server is started without."""
    import os

    built = os.environ.get("VLLM_SHIM_LORA", "")
    return built if os.path.isdir(built) else UNAVAILABLE_LORA + repo_id


@pytest.fixture(autouse=True, scope="session")
def _hub_lora_adapters() -> None:
    """vLLM's test modules download LoRA adapters for their own base models from the hub;
    such an adapter cannot be applied to the embedded model: the stand-in adapter of the
    embedded model's shape is handed out instead."""
    import huggingface_hub

    def snapshot_download(repo_id: str, *args: object, **kwargs: object) -> str:
        return _unavailable_lora(repo_id)

    huggingface_hub.snapshot_download = snapshot_download


@pytest.fixture(autouse=True, scope="session")
def _hub_tokenizers() -> None:
    """A test's ``AutoTokenizer.from_pretrained("org/name")`` gets the embedded model's
    tokenizer: the model served under that name (no hub download)."""
    import os

    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    original = AutoTokenizer.from_pretrained

    def from_pretrained(name: object, *args: object, **kwargs: object) -> object:
        if isinstance(name, str) and not os.path.exists(name):
            return get_tokenizer(name)
        return original(name, *args, **kwargs)

    AutoTokenizer.from_pretrained = from_pretrained


@pytest.fixture(scope="session")
def qwen3_lora_files() -> str:
    return _unavailable_lora("charent/self_cognition_Alice")


@pytest.fixture
def sample_structured_outputs_choices(sample_choice: list[str]) -> list[str]:
    """The newer name of tests/entrypoints/conftest.py's ``sample_choice``."""
    return sample_choice


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        reason = known.not_applicable(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=known.NA_PREFIX + reason))
