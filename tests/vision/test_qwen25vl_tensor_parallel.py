"""Qwen2.5-VL under --tensor-parallel-size 2 (CPU, gloo): the language model sharded as for
text, the dynamic-resolution tower on rank 0 alone. Each prefill's order carries the image
rows and M-RoPE's ``[3, bs, q]`` positions (an image's tokens at its start plus their row
and column, the text after it behind its token index), so the other rank rotates its heads
as rank 0 does: the greedy tokens equal transformers' for images of other sizes and aspect
ratios, one and two per prompt, in eager and compile mode (nothing compiled while serving)."""

from __future__ import annotations

import pytest
from qwen_helpers import IMAGE
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a spawned rank: ~15 s eager, ~3.5 min compile on two cores

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def cases() -> list[tuple[str, list]]:
    """A wide image; a tall one and a square one (45, 21 and 16 image tokens)."""
    wide, tall, square = (random_image(w, h, seed=i)
                          for i, (w, h) in enumerate([(70, 40), (30, 100), (64, 64)]))
    return [(f"<|user|>{IMAGE}the quick brown fox</s><|assistant|>", [wide]),
            (f"<|user|>{IMAGE}the lazy dog{IMAGE}numbers</s><|assistant|>", [tall, square])]


def _generate(llm: LLM, items: list[tuple[str, list]],
              params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_matches_transformers(tiny_qwen25vl) -> None:
    folder, ref = tiny_qwen25vl
    references = [ref.ids(t, ims, 8) for t, ims in cases()]
    # another image, another answer: the rows and positions must really reach rank 1
    assert ref.ids(cases()[0][0], [random_image(40, 70, seed=9)], 8) != references[0]
    llm = LLM(folder, tensor_parallel_size=2, dtype="float32", block_size=8,
              enforce_eager=True, max_model_len=256, max_num_seqs=4,
              enable_prefix_caching=False, max_num_batched_tokens=64,  # chunked prefill
              limit_mm_per_prompt='{"image": 2}')
    try:
        assert llm.engine.runner.vision is not None  # rank 0 encodes
        assert _generate(llm, cases()) == references
        # again (no prefix cache): rank 0's encoder cache answers, the rows and the
        # positions still travel
        assert _generate(llm, cases()) == references
        assert llm.engine.runner.vision.cache.hits > 0
    finally:
        llm.shutdown()


def test_tp2_compile_mode_compiles_nothing_while_serving(tiny_qwen25vl, tmp_path) -> None:
    """Compile mode at TP 2: rank 0 compiles its encoder buckets and orders every step
    bucket (M-RoPE positions in each) compiled on both ranks before serving; images of
    several sizes then compile nothing, with transformers' tokens."""
    folder, ref = tiny_qwen25vl
    path = tmp_path / "buckets.txt"
    path.write_text("# prompt buckets\n(1, [96], 0)\n# decode buckets\n([1, 2], 1, [8, 32])\n")
    llm = LLM(folder, tensor_parallel_size=2, execution_mode="compile", dtype="float32",
              block_size=8, max_num_seqs=2, max_model_len=128, enable_prefix_caching=False,
              limit_mm_per_prompt='{"image": 2}',
              mm_processor_kwargs='{"min_pixels": 1024, "max_pixels": 2048}',
              environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    try:
        counters = llm.engine.counters
        warmed = counters.compilations(stage="warmup")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        reference = ref.with_bounds(1024, 2048)
        assert _generate(llm, cases(), params) == [reference.ids(t, ims, 4)
                                                   for t, ims in cases()]
        assert counters.compilations(stage="serving") == 0
        assert counters.compilations(stage="warmup") == warmed
    finally:
        llm.shutdown()
