"""An EAGLE head through the real HTTP server: vLLM's --speculative-config JSON with a head
folder, a greedy completion via the openai SDK identical to the offline engine without
speculation, and the vllm:spec_decode_* counters showing accepted drafts."""

from __future__ import annotations

import copy
import json

import openai
import pytest
import torch
from server_process import MODEL_NAME, TINY_FLAGS, start_server
from spec_draft import save
from spec_eagle import save_head

from server import LLM, SamplingParams


@pytest.mark.slow
def test_a_completion_through_an_eagle_head(tiny_model, tmp_path) -> None:
    _, model, tokenizer = tiny_model
    quiet = copy.deepcopy(model)  # layers that add almost nothing: the head agrees
    with torch.no_grad():
        for layer in quiet.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
            layer.mlp.down_proj.weight.mul_(1e-3)
    target = save(quiet, tokenizer, tmp_path / "target")
    head = save_head(target, tmp_path / "head", "eagle", copies_embedding=True)
    prompt = "a quick brown fox jumps over"
    want = LLM(target, dtype="float32", block_size=16).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    config = json.dumps({"method": "eagle", "model": head, "num_speculative_tokens": 3})
    server = start_server(target, *TINY_FLAGS, "--speculative-config", config)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want[0].outputs[0].text
        assert server.metric("vllm:spec_decode_num_drafts_total") > 0
        assert server.metric("vllm:spec_decode_num_accepted_tokens_total") > 0
    finally:
        server.stop()
