"""Compile mode: every pooling bucket compiled before serving, none after."""

from __future__ import annotations

import random

import pytest

from server.engine.llm import LLM
from server.engine.pooling.params import PoolingParams
from tests.conftest import CORPUS


@pytest.mark.slow
def test_no_serving_compilations_over_random_mix(st_folder) -> None:
    llm = LLM(st_folder("bert", "mean", True), execution_mode="compile", max_model_len=64,
              max_num_seqs=4, dtype="float32")
    counters = llm.engine.counters
    warmed = counters.compilations(stage="warmup")
    assert warmed > 0
    rng = random.Random(0)
    words = " ".join(CORPUS).split()
    for _ in range(6):
        texts = [" ".join(rng.choices(words, k=rng.randint(1, 40)))
                 for _ in range(rng.randint(1, 9))]
        # longer texts are cut to the context (the last 64 tokens kept)
        cut = PoolingParams(truncate_prompt_tokens=-1)
        assert len(llm.embed(texts, cut)) == len(texts)
    assert counters.compilations(stage="serving") == 0
