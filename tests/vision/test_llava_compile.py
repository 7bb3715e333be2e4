"""Compile mode: every prefill, decode and encoder bucket is compiled before serving, and
a randomized sweep of image sizes (one or two images per prompt) then compiles nothing and
misses no bucket, with the answers of eager execution."""

from __future__ import annotations

import random

import pytest
from vision_helpers import random_image

from server.engine.llm import LLM
from server.engine.sampling_params import SamplingParams
from server.hpu.types import SyncPoint

BUCKETS = "# prompt buckets\n(1, [48, 96], 0)\n# decode buckets\n([1, 2], 1, [8, 32])\n"


@pytest.mark.slow  # compiles 4 step buckets and 3 encoder buckets (~2 min on two cores)
def test_random_image_sizes_compile_nothing_while_serving(tiny_llava, tmp_path) -> None:
    path = tmp_path / "buckets.txt"
    path.write_text(BUCKETS)
    common = dict(dtype="float32", block_size=8, max_num_seqs=2, max_model_len=128,
                  limit_mm_per_prompt='{"image": 2}',
                  environ={"VLLM_BUCKETING_FROM_FILE": str(path)})
    compiled = LLM(tiny_llava[0], execution_mode="compile", **common)
    counters = compiled.engine.counters
    encoder = compiled.engine.runner.vision
    assert encoder.buckets == [1, 2, 4]
    assert counters.compilations(SyncPoint.ENCODER, "warmup") == len(encoder.buckets)
    warmed = counters.compilations(stage="warmup")
    rng = random.Random(0)
    prompts = []
    for i in range(12):
        count = rng.choice([1, 2])
        images = [random_image(rng.randint(8, 200), rng.randint(8, 200), seed=100 + 2 * i + k)
                  for k in range(count)]
        text = "<|user|>" + "".join("<image>\n" for _ in images) + "the fox</s><|assistant|>"
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in compiled.generate(prompts, params)]
    assert counters.compilations(stage="serving") == 0
    assert counters.compilations(stage="warmup") == warmed
    for label in ("prefill", "decode", "encoder"):
        assert counters._misses.labels(counters.model_name, label)._value.get() == 0, label
    eager = LLM(tiny_llava[0], enforce_eager=True, **common)
    assert got == [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params)]
