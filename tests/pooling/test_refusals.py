"""What the pooling runner refuses, with a message that says so."""

from __future__ import annotations

import pytest

from server.engine.llm import LLM


def test_yes_no_reranker_is_refused(tiny_model) -> None:
    # a causal LM has no class head: Qwen3-Reranker's yes/no-logit scoring is named as
    # unsupported instead of a head being made up
    with pytest.raises(ValueError, match="Qwen3-Reranker") as err:
        LLM(tiny_model[0], runner="pooling", convert="classify")
    assert "ForSequenceClassification" in str(err.value)
