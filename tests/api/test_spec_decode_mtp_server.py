"""DeepSeek's MTP layer through the real HTTP server: vLLM's --speculative-config JSON with
``"method": "mtp"`` and no model, a greedy chat completion via the openai SDK identical to
the offline engine without speculation, and the vllm:spec_decode_* counters showing
accepted drafts (the layer agrees with its damped target, tests/spec_mtp.py)."""

from __future__ import annotations

import json

import openai
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server
from spec_mtp import add_mtp, damp

from server import LLM, SamplingParams


@pytest.mark.slow
def test_a_completion_through_the_mtp_layer(tiny_model_factory, tmp_path) -> None:
    folder = tiny_model_factory(model_type="deepseek_v3", tie=False)[0]
    target = add_mtp(damp(folder, tmp_path / "damped"), tmp_path / "mtp",
                     copies_embedding=True)
    prompt = "a quick brown fox jumps over"
    want = LLM(target, dtype="float32", block_size=16).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    config = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 2})
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


@pytest.mark.slow
def test_a_target_without_mtp_layers_fails_at_start_up(tiny_model) -> None:
    """The server does not open its port; its log names the reason."""
    config = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    server = start_server(tiny_model[0], *TINY_FLAGS, "--speculative-config", config,
                          wait=False)
    try:
        assert server.proc.wait(timeout=180) != 0
        assert "mtp: the target (llama) has no DeepSeek MTP layers" in server.log()
    finally:
        server.stop()
