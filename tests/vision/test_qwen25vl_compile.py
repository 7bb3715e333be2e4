"""Qwen2.5-VL in compile mode: the packed-patch encoder buckets (bounded by
``--mm-processor-kwargs``' pixel bounds), the prefill and decode buckets with M-RoPE's
[3, bs, q] positions, all compiled before serving; a randomized sweep of image sizes and
aspect ratios (one or two images per prompt) then compiles nothing, misses no bucket, and
answers as transformers does."""

from __future__ import annotations

import random

import pytest
from qwen_helpers import IMAGE
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams
from server.hpu.types import SyncPoint

# the prompts share their first block (the chat prefix before the image): prefix caching
# makes their prefills run after a 1-block context
BUCKETS = ("# prompt buckets\n(1, [48, 96], 0)\n(1, [96], 1)\n"
           "# decode buckets\n([1, 2], 1, [8, 32])\n")
BOUNDS = '{"min_pixels": 1024, "max_pixels": 2048}'  # 16 to 32 tokens an image


@pytest.mark.slow  # compiles 7 step buckets and 4 encoder buckets (~4 min on two cores)
def test_random_image_sizes_compile_nothing_while_serving(tiny_qwen25vl, tmp_path) -> None:
    folder, ref = tiny_qwen25vl
    path = tmp_path / "buckets.txt"
    path.write_text(BUCKETS)
    llm = LLM(folder, execution_mode="compile", dtype="float32", block_size=8,
              max_num_seqs=2, max_model_len=128, limit_mm_per_prompt='{"image": 2}',
              mm_processor_kwargs=BOUNDS, environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    counters = llm.engine.counters
    encoder = llm.engine.runner.vision
    assert encoder.buckets == [64, 128, 256, 512]
    assert counters.compilations(SyncPoint.ENCODER, "warmup") == len(encoder.buckets)
    warmed = counters.compilations(stage="warmup")
    rng = random.Random(0)
    items = []
    for i in range(10):
        images = [random_image(rng.randint(8, 200), rng.randint(8, 200), seed=100 + 2 * i + k)
                  for k in range(rng.choice([1, 2]))]
        items.append(("<|user|>" + IMAGE * len(images) + "the fox</s><|assistant|>", images))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in items],
                        params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert counters.compilations(stage="serving") == 0
    assert counters.compilations(stage="warmup") == warmed
    for label in ("prefill", "decode", "encoder"):
        assert counters._misses.labels(counters.model_name, label)._value.get() == 0, label
    reference = ref.with_bounds(1024, 2048)
    assert got == [reference.ids(t, ims, 6) for t, ims in items]
