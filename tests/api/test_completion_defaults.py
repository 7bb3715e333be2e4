"""Completions without max_tokens stop after 16 tokens, as OpenAI's legacy completions and
vLLM do (found by vLLM's test_completion.py, whose requests leave it unset); an explicit null
still means "up to the context length"."""

from __future__ import annotations

import httpx
import pytest


def complete(server, **body) -> dict:
    resp = httpx.post(server.base_url + "/v1/completions", timeout=600,
                      json={"prompt": "the quick brown", "temperature": 0, "ignore_eos": True,
                            **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_unset_max_tokens_is_16(server) -> None:
    answer = complete(server)
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow  # ~500 tokens: the tiny model's whole context
def test_null_max_tokens_runs_to_the_context(server) -> None:
    answer = complete(server, max_tokens=None)
    usage = answer["usage"]
    assert usage["completion_tokens"] > 16
    card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == card["max_model_len"]


def test_truncation_side_picks_the_end_truncate_prompt_tokens_keeps(server) -> None:
    """vLLM's truncation_side (found by test_completion.py): "right" keeps the prompt's
    first tokens, "left" (the default) its last."""
    prompt = list(range(5, 13))
    kept = {}
    for side in ("right", "left", None):
        answer = complete(server, prompt=prompt, max_tokens=1, return_token_ids=True,
                          truncate_prompt_tokens=4,
                          **({"truncation_side": side} if side else {}))
        kept[side] = answer["choices"][0]["prompt_token_ids"]
    assert kept == {"right": prompt[:4], "left": prompt[-4:], None: prompt[-4:]}
    bad = httpx.post(server.base_url + "/v1/completions", json={
        "prompt": prompt, "truncate_prompt_tokens": 4, "truncation_side": "middle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"


def test_echo_of_token_ids_keeps_special_tokens(server, tiny_model) -> None:
    """vLLM echoes a token-id prompt decoded with its special tokens (found by
    test_completion.py's test_echo_logprob_completion)."""
    hf = tiny_model[2]
    prompt = [hf.bos_token_id, *hf.encode("the quick", add_special_tokens=False)]
    answer = complete(server, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    text = answer["choices"][0]["text"]
    assert text.startswith(hf.decode(prompt, skip_special_tokens=False)), text
    assert text.startswith(hf.bos_token)
