"""Gemma 3 under --tensor-parallel-size 2 (CPU, gloo): the language model sharded as for
text, the SigLIP tower and projector on rank 0 alone. Each prefill's order carries the image
rows and the attention metadata's ``image_ends`` (where each query's image ends: its tokens
see each other both ways), so the other rank masks its heads as rank 0 does: the greedy
tokens equal transformers' (not its causal-mask answers) for images of other sizes, one and
two per prompt, in eager and compile mode (nothing compiled while serving)."""

from __future__ import annotations

import pytest
from gemma3_helpers import causal_reference_ids, gemma3_prompt
from vision_helpers import random_image, reference_ids

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a spawned rank: ~15 s eager, ~3.5 min compile on two cores

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def cases() -> list[tuple[str, list]]:
    """A wide image; a tall one and a small one (each resized to the tower's 32 x 32)."""
    wide, tall, small = (random_image(w, h, seed=i)
                         for i, (w, h) in enumerate([(70, 40), (30, 100), (12, 9)]))
    return [(gemma3_prompt("<start_of_image>the quick brown fox"), [wide]),
            (gemma3_prompt("the lazy dog<start_of_image>and<start_of_image>numbers"),
             [tall, small])]


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}}
                         for t, ims in cases()], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_matches_transformers(tiny_gemma3) -> None:
    folder, model, processor = tiny_gemma3
    references = [reference_ids(model, processor, t, ims, 8) for t, ims in cases()]
    # a rank that attended causally over the images would answer otherwise
    assert [causal_reference_ids(model, processor, t, ims, 8)
            for t, ims in cases()] != references
    llm = LLM(folder, tensor_parallel_size=2, dtype="float32", block_size=8,
              enforce_eager=True, max_model_len=256, max_num_seqs=4,
              enable_prefix_caching=False, limit_mm_per_prompt='{"image": 2}')
    try:
        assert llm.engine.runner.vision is not None  # rank 0 encodes
        assert _generate(llm) == references
        # again (no prefix cache): rank 0's encoder cache answers, the rows and the
        # image ends still travel
        assert _generate(llm) == references
        assert llm.engine.runner.vision.cache.hits > 0
    finally:
        llm.shutdown()


def test_tp2_compile_mode_compiles_nothing_while_serving(tiny_gemma3, tmp_path) -> None:
    """Compile mode at TP 2: every prefill graph takes the image ends (blank without
    images) on both ranks, compiled before serving; the prompts then compile nothing, with
    transformers' tokens."""
    folder, model, processor = tiny_gemma3
    path = tmp_path / "buckets.txt"
    path.write_text("# prompt buckets\n(1, [96], 0)\n# decode buckets\n([1, 2], 1, [8, 32])\n")
    llm = LLM(folder, tensor_parallel_size=2, execution_mode="compile", dtype="float32",
              block_size=8, max_num_seqs=2, max_model_len=128, enable_prefix_caching=False,
              limit_mm_per_prompt='{"image": 2}',
              environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    try:
        counters = llm.engine.counters
        warmed = counters.compilations(stage="warmup")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert _generate(llm, params) == [reference_ids(model, processor, t, ims, 4)
                                          for t, ims in cases()]
        assert counters.compilations(stage="serving") == 0
        assert counters.compilations(stage="warmup") == warmed
    finally:
        llm.shutdown()
