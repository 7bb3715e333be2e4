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


def test_tp2_compile_mode_compiles_nothing_while_serving(tiny_llava, tmp_path) -> None:
    """Compile mode at TP 2: rank 0 compiles the encoder buckets and orders every step
    bucket compiled on both ranks before serving; images of random sizes then compile
    nothing, with transformers' tokens."""
    import random

    from test_llava_compile import BUCKETS
    from vision_helpers import random_image

    _, model, processor = tiny_llava
    path = tmp_path / "buckets.txt"
    path.write_text(BUCKETS)
    llm = LLM(tiny_llava[0], tensor_parallel_size=2, execution_mode="compile",
              dtype="float32", block_size=8, max_num_seqs=2, max_model_len=128,
              limit_mm_per_prompt='{"image": 2}',
              environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    try:
        counters = llm.engine.counters
        warmed = counters.compilations(stage="warmup")
        rng = random.Random(3)
        items = []
        for i in range(4):
            images = [random_image(rng.randint(8, 200), rng.randint(8, 200), 500 + 2 * i + k)
                      for k in range(rng.choice([1, 2]))]
            items.append(("<|user|>" + "<image>\n" * len(images) + "the fox</s><|assistant|>",
                          images))
        outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}}
                             for t, ims in items], GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == [
            reference_ids(model, processor, t, ims, 8) for t, ims in items]
        assert counters.compilations(stage="serving") == 0
        assert counters.compilations(stage="warmup") == warmed
    finally:
        llm.shutdown()
