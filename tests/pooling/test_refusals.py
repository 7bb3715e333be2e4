"""What the pooling runner refuses, with a message that says so."""

from __future__ import annotations

import pytest

from server.engine.llm import LLM


def test_classify_without_head_is_refused(tiny_model) -> None:
    # a causal LM has no class head: without classifier_from_token (--hf-overrides) none is
    # made up, and the message says how to get one
    with pytest.raises(ValueError, match="classifier_from_token") as err:
        LLM(tiny_model[0], runner="pooling", convert="classify")
    assert "ForSequenceClassification" in str(err.value)
    assert "Qwen3-Reranker" in str(err.value)
