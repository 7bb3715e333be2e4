"""Completions without max_tokens stop after 16 tokens, as OpenAI's legacy completions and
vLLM do (found by vLLM's test_completion.py, whose requests leave it unset); an explicit null
still means "up to the context length"."""

from __future__ import annotations

import httpx


def complete(server, **body) -> dict:
    resp = httpx.post(server.base_url + "/v1/completions", timeout=120,
                      json={"prompt": "the quick brown", "temperature": 0, "ignore_eos": True,
                            **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_unset_max_tokens_is_16(server) -> None:
    answer = complete(server)
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["finish_reason"] == "length"


def test_null_max_tokens_runs_to_the_context(server) -> None:
    answer = complete(server, max_tokens=None)
    usage = answer["usage"]
    assert usage["completion_tokens"] > 16
    card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == card["max_model_len"]
