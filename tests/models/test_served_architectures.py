"""Each architecture of the registry served once over HTTP: a tiny random model built by
transformers, a greedy completion through the real server equal to transformers' own."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_process import MODEL_NAME, TINY_FLAGS, start_server
from transformers import GenerationConfig

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

NEW_TOKENS = 12


# Gemma 3 with an 8-token window: its 23 tokens cross it in the sliding layers (Llama 4's
# 8-token attention chunks, likewise)
WINDOWS = {"gemma3_text": 8, "llama4_text": 8}


@pytest.mark.parametrize("model_type", ["qwen3", "granite", "phi3", "mixtral", "qwen3_moe",
                                        "gemma2", "gemma3_text", "deepseek_v3",
                                        "llama4_text", "qwen3_next", "qwen3_5_text",
                                        "qwen3_5_moe_text"])
def test_architecture_served_over_http(tiny_model_factory, model_type: str) -> None:
    window = {"sliding_window": WINDOWS[model_type]} if model_type in WINDOWS else {}
    folder, hf_model, hf_tokenizer = tiny_model_factory(model_type=model_type, tie=True,
                                                        **window)
    prompt = torch.randint(3, hf_model.config.vocab_size, (11,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    server = start_server(folder, *TINY_FLAGS)
    try:
        resp = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True})
    finally:
        server.stop()
    assert resp.status_code == 200, resp.text
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0))
    expected = hf_tokenizer.decode(out[0, len(prompt):].tolist())
    assert resp.json()["choices"][0]["text"] == expected
    assert resp.json()["usage"]["completion_tokens"] == NEW_TOKENS
