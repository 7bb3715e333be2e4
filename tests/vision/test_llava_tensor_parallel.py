"""LLaVA under --tensor-parallel-size 2 (CPU, gloo): the language model sharded as for text,
the vision encoder on rank 0, whose image rows travel with each prefill's order; the greedy
tokens equal one rank's and transformers' (one and two images per prompt, chunked prefill
included)."""

from __future__ import annotations

import pytest
from test_llava_offline import GREEDY, cases
from vision_helpers import reference_ids

from server.engine.llm import LLM

pytestmark = pytest.mark.slow  # a spawned rank and its rendezvous (~30 s on two cores)


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}}
                         for t, ims in cases()], GREEDY)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_matches_one_rank_and_transformers(tiny_llava) -> None:
    _, model, processor = tiny_llava
    references = [reference_ids(model, processor, t, ims, 8) for t, ims in cases()]
    options = dict(dtype="float32", block_size=8, enforce_eager=True, max_model_len=256,
                   max_num_seqs=4, max_num_batched_tokens=64)  # two images span two steps
    llm = LLM(tiny_llava[0], tensor_parallel_size=2, **options)
    try:
        assert llm.engine.runner.vision is not None  # rank 0 encodes
        assert _generate(llm) == references
        # the same images again: rank 0's encoder cache answers, the rows still travel
        assert _generate(llm) == references
        assert llm.engine.runner.vision.cache.hits > 0
    finally:
        llm.shutdown()
