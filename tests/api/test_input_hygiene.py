"""Hostile or careless input gets a 400 naming the field, never a 500 or a silent change.

Raw JSON bodies are sent as bytes: ``Infinity``, ``NaN`` and lone ``\\ud800`` escapes are
what a client library may emit, and what ``json.dumps`` of a Python dict would not show.
"""

from __future__ import annotations

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=body.encode(), timeout=60,
                      headers={"content-type": "application/json"})


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def assert_400(resp: httpx.Response, param: str, *words: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


def alive(server) -> bool:
    return httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    (CHAT, '{"messages": [{"role": "user", "content": "a\\u0000b\\ud800c"}]}',
     "messages.0.content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud83d"]}',
     "stop.1"),
    (COMPLETIONS, '{"prompt": "x\\ud800"}', "prompt"),
    (COMPLETIONS, '{"prompt": ["fine", "\\ud800"]}', "prompt.1"),
    (COMPLETIONS, '{"prompt": "x", "stop": "\\udc00"}', "stop"),
    (COMPLETIONS, '{"prompt": "x", "model": "\\ud800"}', "model"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path: str, body: str,
                                                  param: str) -> None:
    assert_400(raw(server, path, body), param, "surrogate")
    assert alive(server)


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
def test_a_content_part_whose_type_is_not_a_string_is_400(server, path: str) -> None:
    """The content-part union reads its member from "type": a list there is a 400, not a
    500 (found by the schema fuzzer)."""
    resp = raw(server, path, '{"messages": [{"role": "user", "content": '
                             '[{"type": [{}], "text": true}]}]}')
    assert resp.status_code == 400, resp.text
    assert alive(server)


def test_nul_is_text_like_any_other(server) -> None:
    resp = raw(server, CHAT, '{"messages": [{"role": "user", "content": "a\\u0000b"}], '
                             '"max_tokens": 2, "stop": ["\\u0000"]}')
    assert resp.status_code == 200, resp.text
    resp = raw(server, COMPLETIONS, '{"prompt": "a\\u0000b", "max_tokens": 2, "echo": true}')
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"].startswith("a\x00b")
    tokens = post(server, "/tokenize", prompt="a\x00b").json()["tokens"]
    assert post(server, "/detokenize", tokens=tokens).json()["prompt"].endswith("a\x00b")


@pytest.mark.parametrize("field, literal", [
    ("temperature", "Infinity"), ("temperature", "NaN"), ("top_p", "-Infinity"),
    ("presence_penalty", "Infinity"), ("frequency_penalty", "NaN"), ("min_p", "NaN"),
    ("repetition_penalty", "Infinity"), ("temperature", "1e400"),
])
def test_non_finite_numbers_are_400_naming_the_field(server, field: str, literal: str) -> None:
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
    assert_400(raw(server, CHAT, body), field, "finite")


def test_non_finite_logit_bias_is_400(server) -> None:
    assert_400(raw(server, COMPLETIONS, '{"prompt": "x", "logit_bias": {"5": Infinity}}'),
               "logit_bias.5", "finite")


@pytest.mark.parametrize("path, fields, param, words", [
    (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop", ["4", "--max-stop-strings"]),
    (CHAT, {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias",
     ["1024", "--max-logit-bias"]),
    (CHAT, {"stop_token_ids": list(range(1025))}, "stop_token_ids", ["--max-stop-token-ids"]),
    (CHAT, {"messages": MSG * 1025}, "messages", ["1024", "--max-messages"]),
    (COMPLETIONS, {"prompt": ["x"] * 129}, "prompt", ["128", "--max-prompts"]),
    (COMPLETIONS, {"prompt": ["x"] * 2, "n": 100, "max_tokens": 700}, "max_tokens",
     ["140000", "--max-tokens-per-request"]),
    # sequences are checked before tokens: 384 of them would also ask for too many tokens
    (COMPLETIONS, {"prompt": ["x"] * 3, "n": 128}, "n", ["384", "--max-seqs-per-request"]),
    (CHAT, {"min_tokens": 10**12}, "min_tokens", []),
    (CHAT, {"min_tokens": 600, "max_tokens": None}, "min_tokens", ["512"]),
    (CHAT, {"top_k": 2**70}, "top_k", []),
    # found by the fuzzer: logits / 1e-300 overflow, NaN logprobs, a 500 writing the JSON
    (COMPLETIONS, {"repetition_penalty": 1e-300, "logprobs": 2}, "repetition_penalty", []),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens", []),
    (CHAT, {"priority": 1}, "priority", ["--scheduling-policy priority"]),
    (COMPLETIONS, {"priority": 2**64}, "priority", []),
])
def test_limits_are_400_naming_the_field(server, path: str, fields: dict, param: str,
                                         words: list[str]) -> None:
    body = {"messages": MSG} if path == CHAT else {}
    assert_400(post(server, path, **{**body, **fields}), param, *words)
    assert alive(server)


def test_top_k_beyond_the_vocabulary_is_clamped(server) -> None:
    base = {"prompt": "numbers 1 2", "max_tokens": 6, "ignore_eos": True, "seed": 3}
    plain = post(server, COMPLETIONS, **base).json()["choices"][0]["text"]
    huge = post(server, COMPLETIONS, **base, top_k=10**6)
    assert huge.status_code == 200 and huge.json()["choices"][0]["text"] == plain


@pytest.mark.parametrize("path, field, value", [
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "prediction", {"type": "content", "content": "draft"}),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "logits_processors", ["x"]),
    (CHAT, "thinking_token_budget", 10),
    (COMPLETIONS, "thinking_token_budget", 0),
    (CHAT, "chat_template", "{{ messages }}"),
    (COMPLETIONS, "best_of", 3),
])
def test_answer_changing_fields_are_refused_not_ignored(server, path: str, field: str,
                                                        value) -> None:
    body = {"messages": MSG} if path == CHAT else {"prompt": "x"}
    error = assert_400(post(server, path, **body, **{field: value}), field, "not supported")
    assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path, fields", [
    (CHAT, {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
            "parallel_tool_calls": False, "modalities": ["text"], "store": False,
            "metadata": {"k": "v"}, "service_tier": "auto", "user": "u", "prediction": None,
            "some_future_field": {"a": [1, 2]}}),
    (COMPLETIONS, {"best_of": 1, "response_format": None, "unknown": 1}),
])
def test_fields_that_change_nothing_are_accepted(server, path: str, fields: dict) -> None:
    body = {"messages": MSG} if path == CHAT else {"prompt": "x"}
    assert post(server, path, **body, **fields, max_tokens=2).status_code == 200


@pytest.fixture(scope="module")
def tight_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--max-stop-strings", "2",
                       "--max-logprobs", "3", "--max-prompts", "2", "--max-messages", "2",
                       "--max-logit-bias", "2", "--max-tokens-per-request", "64")
    yield srv
    srv.stop()


def test_limits_follow_their_flags(tight_server) -> None:
    srv = tight_server
    ok = {"model": MODEL_NAME, "max_tokens": 4}
    assert post(srv, CHAT, messages=MSG * 2, stop=["a", "b"], logprobs=True, top_logprobs=3,
                logit_bias={"1": 1, "2": 1}, **ok).status_code == 200
    assert post(srv, COMPLETIONS, prompt=["a", "b"], logprobs=3, n=2, **ok).status_code == 200
    assert_400(post(srv, CHAT, messages=MSG * 3, **ok), "messages", "--max-messages")
    assert_400(post(srv, CHAT, messages=MSG, stop=["a", "b", "c"], **ok), "stop")
    assert_400(post(srv, CHAT, messages=MSG, logprobs=True, top_logprobs=4, **ok),
               "top_logprobs", "--max-logprobs")
    assert_400(post(srv, COMPLETIONS, prompt="a", logprobs=4, **ok), "logprobs")
    assert_400(post(srv, COMPLETIONS, prompt=["a", "b", "c"], **ok), "prompt")
    assert_400(post(srv, CHAT, messages=MSG, logit_bias={"1": 1, "2": 1, "3": 1}, **ok),
               "logit_bias")
    assert_400(post(srv, COMPLETIONS, prompt=["a", "b"], n=3, max_tokens=11), "max_tokens",
               "66")
    # max_tokens null (unset is 16 in completions, as in vLLM) counts as the context length
    assert_400(post(srv, COMPLETIONS, prompt="a", max_tokens=None), "n", "unset",
               "--max-tokens-per-request")


def test_help_and_docs_document_every_limit_flag() -> None:
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-m", "server", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = page.split("\n## Limits and failure behaviour\n", 1)[1].split("\n## ", 1)[0]
    for flag in ("--max-logprobs", "--max-stop-strings", "--max-stop-token-ids",
                 "--max-logit-bias", "--max-messages", "--max-prompts",
                 "--max-tokens-per-request", "--max-seqs-per-request", "--max-client-seqs",
                 "--max-waiting-requests", "--preprocess-workers", "--timeout-idle-connection",
                 "--max-idle-connections-per-address", "--max-grammar-bytes",
                 "--max-grammar-alternatives", "--grammar-compile-timeout",
                 "--health-stall-timeout", "--timeout-keep-alive", "--timeout-request-header",
                 "--timeout-request-body", "--limit-concurrency", "--max-request-body-bytes"):
        assert flag in out and f"`{flag}`" in section, flag


def test_the_surrogate_message_names_the_code_point(server) -> None:
    error = assert_400(raw(server, COMPLETIONS, '{"prompt": "x\\udc01"}'), "prompt")
    assert "U+DC01 at index 1" in error["message"], error["message"]


@pytest.mark.parametrize("prompt", [[True, False], [[1, 2], [3, True]]])
def test_booleans_are_not_token_ids(server, prompt: list) -> None:
    assert_400(post(server, COMPLETIONS, prompt=prompt, max_tokens=1), "prompt", "integers")
    assert_400(post(server, "/detokenize", tokens=[1, False]), "tokens", "integers")


def test_tokenize_applies_max_messages(server) -> None:
    assert_400(post(server, "/tokenize", messages=MSG * 1025), "messages", "--max-messages")
