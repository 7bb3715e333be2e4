"""OpenAI's published contract (API specification 2.3.0), on the wire.

Responses are validated with the ``openai`` SDK's own types (generated from the spec) plus the
keys the spec marks required-but-nullable, which those lenient types cannot check:
``choices[].message.refusal``, ``choices[].logprobs`` and ``error.code`` / ``error.param``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types import Completion, ErrorObject
from openai.types.chat import ChatCompletion, ChatCompletionChunk

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "the quick brown fox"}]
# The spec's ``required`` lists where a key must be present even when null.
REQUIRED = {
    "chat.completion": {"id", "object", "created", "model", "choices"},
    "chat.choice": {"index", "message", "finish_reason", "logprobs"},
    "chat.message": {"role", "content", "refusal"},
    "text_completion": {"id", "object", "created", "model", "choices"},
    "text.choice": {"index", "text", "finish_reason", "logprobs"},
    "error": {"message", "type", "param", "code"},
}


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def events(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]


def test_chat_response_matches_the_spec(server, model_name: str) -> None:
    resp = post(server, CHAT, model=model_name, messages=MSG, max_tokens=4, n=2,
                logprobs=True, top_logprobs=2, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ChatCompletion.model_validate(body)
    assert REQUIRED["chat.completion"] <= body.keys()
    for choice in body["choices"]:
        assert REQUIRED["chat.choice"] <= choice.keys()
        assert REQUIRED["chat.message"] <= choice["message"].keys()
        assert choice["message"]["refusal"] is None
    fingerprint = body["system_fingerprint"]
    assert isinstance(fingerprint, str) and fingerprint.startswith("fp_hpu-serve-")


def test_system_fingerprint_is_stable_and_in_every_chunk(server, model_name: str) -> None:
    first = post(server, COMPLETIONS, model=model_name, prompt="hi", max_tokens=2).json()
    Completion.model_validate(first)
    assert REQUIRED["text_completion"] <= first.keys()
    assert all(REQUIRED["text.choice"] <= c.keys() for c in first["choices"])
    stream = post(server, CHAT, model=model_name, messages=MSG, max_tokens=3, stream=True,
                  stream_options={"include_usage": True})
    chunks = [json.loads(e) for e in events(stream)[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert {c["system_fingerprint"] for c in chunks} == {first["system_fingerprint"]}


def test_error_code_is_a_string(server) -> None:
    for resp in (post(server, CHAT, messages=MSG, temperature=-1),
                 post(server, CHAT, model="nope", messages=MSG),
                 httpx.get(server.base_url + "/nowhere")):
        error = resp.json()["error"]
        assert REQUIRED["error"] <= error.keys()
        ErrorObject.model_validate(error)
        assert isinstance(error["code"], str), error
    assert post(server, CHAT, model="nope", messages=MSG).json()["error"]["code"] == \
        "model_not_found"


@pytest.mark.parametrize("path, field, value", [
    (CHAT, "temperature", 2.5),
    (CHAT, "top_p", 1.5),
    (CHAT, "presence_penalty", 2.5),
    (CHAT, "frequency_penalty", -3),
    (CHAT, "n", 129),
    (CHAT, "top_logprobs", 21),
    (CHAT, "seed", 2**64),
    (COMPLETIONS, "logprobs", 6),
    (COMPLETIONS, "temperature", 5),
])
def test_spec_ranges_are_400_naming_the_field(server, path: str, field: str, value) -> None:
    body = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    if field == "top_logprobs":
        body["logprobs"] = True
    resp = post(server, path, max_tokens=2, **body, **{field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_spec_range_edges_are_accepted(server, model_name: str) -> None:
    greedy = post(server, COMPLETIONS, prompt="numbers 1 2", max_tokens=6, temperature=0,
                  ignore_eos=True).json()["choices"][0]["text"]
    # top_p 0 is valid for OpenAI (only the most likely token; vLLM refuses it): greedy
    top_p_0 = post(server, COMPLETIONS, prompt="numbers 1 2", max_tokens=6, top_p=0,
                   temperature=1.5, ignore_eos=True)
    assert top_p_0.status_code == 200 and top_p_0.json()["choices"][0]["text"] == greedy
    for fields in ({"temperature": 2}, {"presence_penalty": -2, "frequency_penalty": 2},
                   {"logprobs": 5}):
        assert post(server, COMPLETIONS, prompt="hi", max_tokens=2, **fields).status_code == 200
    resp = post(server, CHAT, messages=MSG, max_tokens=2, logprobs=True, top_logprobs=20)
    assert resp.status_code == 200
    assert len(resp.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_top_logprobs_error_names_top_logprobs(server) -> None:
    resp = post(server, CHAT, messages=MSG, logprobs=True, top_logprobs=21)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["param"] == "top_logprobs"
    assert error["message"].startswith("top_logprobs")


@pytest.mark.parametrize("part, media", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_id": "f"}}, "files"),
])
def test_media_content_parts_are_refused_by_name(server, part: dict, media: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    resp = post(server, CHAT, messages=messages)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages.0.content"
    assert f"{media} are not supported by this text-only model" in error["message"]
    assert "part 1" in error["message"] and part["type"] in error["message"]


def test_health_answers_json(server) -> None:
    resp = httpx.get(server.base_url + "/health")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"status": "ok"}


def test_405_carries_allow(server) -> None:
    resp = httpx.get(server.base_url + CHAT)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["code"] == "method_not_allowed"


def test_openapi_document_declares_what_the_server_answers(server) -> None:
    doc = httpx.get(server.base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if "requestBody" in operation:
                ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
                # Anthropic's routes answer errors in Anthropic's shape
                error = "AnthropicErrorResponse" if path.startswith("/v1/messages") \
                    else "ErrorResponse"
                assert ref == f"#/components/schemas/{error}", path
    chat = doc["paths"][CHAT]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    message = schemas["AssistantMessage"]
    assert "refusal" in message["properties"]
    assert schemas["ErrorInfo"]["properties"]["code"]["anyOf"] == [{"type": "string"},
                                                                    {"type": "null"}]
    health = doc["paths"]["/health"]["get"]["responses"]
    assert "application/json" in health["200"]["content"] and "503" in health
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_non_finite_logprobs_leave_as_the_floor_never_as_invalid_json() -> None:
    from server.api.protocol import CompletionChoice, CompletionLogprobs, CompletionResponse
    from server.api.serving import LOGPROB_FLOOR, json_logprob, sse_chunk

    assert json_logprob(float("-inf")) == json_logprob(float("nan")) == LOGPROB_FLOOR == -9999.0
    assert json_logprob(-1.5) == -1.5
    nan = CompletionLogprobs(token_logprobs=[float("nan")])
    chunk = CompletionResponse(id="x", created=0, model="m", system_fingerprint="fp",
                               choices=[CompletionChoice(index=0, text="a", logprobs=nan)])
    with pytest.raises(ValueError):  # fails the stream (an error event), never sends NaN
        sse_chunk(chunk)
