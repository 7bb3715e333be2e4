"""Bad input gets OpenAI-style errors with the right status; the engine keeps serving."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kwargs)


def assert_error(resp: httpx.Response, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["code"], str) and error["code"]  # OpenAI: a string (or null)
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, words",
    [
        (CHAT, {"messages": MSG, "temperature": -0.5}, ["temperature"]),
        (CHAT, {"messages": MSG, "top_p": 1.5}, ["top_p"]),
        (CHAT, {"messages": MSG, "top_p": -0.1}, ["top_p"]),
        (CHAT, {"messages": MSG, "n": 0}, ["n"]),
        (CHAT, {"messages": MSG, "max_tokens": 0}, ["max_tokens"]),
        (CHAT, {"messages": MSG, "max_tokens": "many"}, ["max_tokens"]),
        (CHAT, {"messages": []}, ["messages"]),
        (CHAT, {"messages": [{"role": "", "content": "x"}]}, ["role"]),
        (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}},
         ["stream_options", "stream"]),
        (COMPLETIONS, {"prompt": "x", "stream": False, "stream_options": {}},
         ["stream_options", "stream"]),
        (CHAT, {"messages": MSG, "logit_bias": {"abc": 1}}, ["logit_bias"]),
        (CHAT, {"messages": MSG, "top_logprobs": 2}, ["logprobs"]),
        (COMPLETIONS, {"prompt": ""}, ["empty"]),
        (COMPLETIONS, {"prompt": []}, ["empty"]),
        (COMPLETIONS, {"prompt": "x", "stop": 5}, ["stop"]),
        (COMPLETIONS, {"prompt": [10**9]}, ["out of vocabulary"]),  # vLLM's words
        (COMPLETIONS, {"max_tokens": 2}, ["prompt", "non-empty"]),
        (COMPLETIONS, {"prompt": None, "prompt_embeds": []}, ["prompt", "non-empty"]),
    ],
)
def test_invalid_values_are_400(server, path: str, body: dict, words: list[str]) -> None:
    assert_error(post(server, path, json=body), 400, *words)


def test_a_custom_role_reaches_the_template(server) -> None:
    """vLLM passes roles beyond OpenAI's to the chat template (chatml writes any name)."""
    body = {"messages": [{"role": "narrator", "content": "Once upon a time"}, *MSG],
            "max_tokens": 2}
    resp = post(server, CHAT, json=body)
    assert resp.status_code == 200, resp.text
    tokens = post(server, "/tokenize", json={"messages": body["messages"]}).json()
    text = post(server, "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "narrator" in text


def test_malformed_json_is_400(server) -> None:
    resp = post(server, CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(resp, 400, "JSON")


def test_unknown_model_is_404(server) -> None:
    assert_error(post(server, CHAT, json={"model": "gpt-9", "messages": MSG}), 404, "gpt-9")


def test_prompt_beyond_context_names_the_numbers(server) -> None:
    resp = post(server, COMPLETIONS, json={"prompt": [5] * 600, "max_tokens": 4})
    assert_error(resp, 400, "512", "600")
    resp = post(server, COMPLETIONS, json={"prompt": [5] * 10, "max_tokens": 600})
    assert_error(resp, 400, "512", "610")


def test_body_size_limit_is_413(server) -> None:
    big = {"prompt": "x" * (17 * 1024 * 1024)}
    assert_error(post(server, COMPLETIONS, json=big), 413)


def test_unknown_fields_are_ignored_and_engine_still_serves(server) -> None:
    resp = post(server, COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True,
                                           "some_future_field": {"a": 1}})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_request_id_is_echoed(server) -> None:
    resp = post(server, COMPLETIONS, json={"prompt": "hi", "max_tokens": 1},
                headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    assert httpx.get(server.base_url + "/version").headers["x-request-id"]


def test_tokenize_detokenize_roundtrip(server) -> None:
    tok = post(server, "/tokenize", json={"prompt": "the quick brown fox"}).json()
    assert tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    text = post(server, "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert "the quick brown fox" in text
    chat = post(server, "/tokenize", json={"messages": MSG}).json()
    assert chat["count"] > 1
    assert_error(post(server, "/detokenize", json={"tokens": [-1]}), 400)
