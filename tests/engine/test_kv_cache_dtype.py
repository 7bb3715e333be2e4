"""--kv-cache-dtype fp8: K/V stored as float8 e4m3, half the bytes; outputs close to the
model-dtype cache (identical first tokens here)."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams


@pytest.fixture(scope="module")
def pair(tiny_model):
    common = dict(dtype="float32", block_size=16, max_num_seqs=8, num_gpu_blocks_override=64)
    return (LLM(tiny_model[0], **common),
            LLM(tiny_model[0], kv_cache_dtype="fp8", **common))


def test_fp8_cache_is_float8_and_a_quarter_of_fp32(pair) -> None:
    plain, fp8 = pair
    k, v = fp8.engine.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert plain.engine.runner.kv_caches[0][0].dtype == torch.float32
    assert fp8.engine.runner.kv_cache_bytes * 4 == plain.engine.runner.kv_cache_bytes
    # and what /metrics reports
    registry = fp8.engine.counters.registry
    assert registry.get_sample_value("hpu_serve:kv_cache_bytes", {
        "model_name": fp8.engine.model_name}) == fp8.engine.runner.kv_cache_bytes
    assert registry.get_sample_value("vllm:cache_config_info", {
        "model_name": fp8.engine.model_name, "block_size": "16",
        "cache_dtype": "float8_e4m3fn", "num_gpu_blocks": "64"}) == 1


def test_fp8_outputs_track_the_plain_cache(pair) -> None:
    plain, fp8 = pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 9, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    # PyTorch ops' prefill reads no cache; the fused CPU kernels' reads its keys back in fp8
    assert [x[0] for x in a] == [x[0] for x in b]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert same / sum(map(len, a)) >= 0.75, (a, b)
    assert fp8.engine.stats().num_free_blocks == fp8.engine.stats().num_blocks
