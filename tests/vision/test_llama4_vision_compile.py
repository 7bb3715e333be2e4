"""Llama 4 vision in compile mode: the encoder's tiles-per-call buckets and the step buckets
compiled before serving; a randomized sweep of image sizes and aspect ratios (one or two
images per prompt, 1 or 2 tiles and a thumbnail each) then compiles nothing, misses no
bucket, and answers as transformers does."""

from __future__ import annotations

import random

import pytest
from llama4_vision_helpers import llama4_prompt, reference
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams
from server.hpu.types import SyncPoint

# one prompt a step (a step's budget holds any two-image prompt whole)
BUCKETS = "# prompt buckets\n(1, [64, 144], 0)\n# decode buckets\n([1], 1, [24])\n"


@pytest.mark.slow  # compiles 3 step buckets and 4 encoder buckets (minutes on two cores)
def test_random_image_sizes_compile_nothing_while_serving(tiny_llama4v, tmp_path) -> None:
    folder, model, tokenizer = tiny_llama4v
    path = tmp_path / "buckets.txt"
    path.write_text(BUCKETS)
    llm = LLM(folder, execution_mode="compile", dtype="float32", block_size=8,
              max_num_seqs=1, max_model_len=160, max_num_batched_tokens=256,
              enable_prefix_caching=False, limit_mm_per_prompt='{"image": 2}',
              mm_processor_kwargs='{"max_patches": 2}',
              environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    counters = llm.engine.counters
    encoder = llm.engine.runner.vision
    assert encoder.buckets == [1, 2, 4, 6]  # tiles per call: 2 images of 2 tiles + thumbnail
    assert counters.compilations(SyncPoint.ENCODER, "warmup") == len(encoder.buckets)
    warmed = counters.compilations(stage="warmup")
    rng = random.Random(0)
    items = []
    for i in range(8):
        images = [random_image(rng.randint(8, 200), rng.randint(8, 200), seed=100 + 2 * i + k)
                  for k in range(rng.choice([1, 2]))]
        items.append((llama4_prompt("<|image|>" * len(images) + "the fox"), images))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert counters.compilations(stage="serving") == 0
    assert counters.compilations(stage="warmup") == warmed
    for label in ("prefill", "decode", "encoder"):
        assert counters._misses.labels(counters.model_name, label)._value.get() == 0, label
    tiler = llm.engine.input_processor.images  # the engine's own: the tiles it served
    expected = []
    for text, images in items:
        out = tiler(images)
        expected.append(reference(model, tokenizer, text, out["pixel_values"],
                                  out["aspect_ratios"], 6)[1])
    assert got == expected
    assert sum(len(tiler(ims)["aspect_ratios"]) for _, ims in items) > 8  # two-image prompts
