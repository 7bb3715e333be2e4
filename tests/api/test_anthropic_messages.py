"""Anthropic's Messages API (/v1/messages) through the official ``anthropic`` SDK, in
process: a scripted engine writes what a tool-calling or reasoning model writes, so each
mapping (blocks in, blocks out, stop reasons, events, errors) is checked exactly. The real
model behind a real server is in test_anthropic_server.py."""

from __future__ import annotations

import json

import anthropic
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from test_sdk_error_types import StubEngine

from server.api.app import build_app
from server.config import ChatOptions, ServerConfig
from server.engine.errors import EngineDeadError, RequestFailedError

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = ["Let me check. ", "<tool", "_call>\n", '{"name": "get_weather", ',
               '"arguments": {"city": "Pa', 'ris"}}', "\n</tool_call>"]
AUTO_TOOLS = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


def scripted(script: list[str], api_key: str | None = None, **chat: object
             ) -> anthropic.Anthropic:
    engine = FakeEngine(script)
    config = ServerConfig(chat=ChatOptions(**chat), api_key=api_key)
    client = anthropic.Anthropic(base_url="http://testserver", api_key=api_key or "unused",
                                 max_retries=0, http_client=TestClient(build_app(engine, config)))
    client.engine = engine  # type: ignore[attr-defined]
    return client


def both(client: anthropic.Anthropic, **fields: object) -> tuple[dict, dict]:
    """(created, streamed) readings of one request, as plain dicts."""
    fields = {"model": "fake-model", "max_tokens": 100, "messages": ASK, **fields}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    return reading(whole), reading(streamed)


def reading(message: anthropic.types.Message) -> dict:
    blocks = []
    for b in message.content:
        if b.type == "text":
            blocks.append(("text", b.text))
        elif b.type == "thinking":
            assert b.signature  # clients send it back with the block
            blocks.append(("thinking", b.thinking))
        else:
            assert b.type == "tool_use" and b.id.startswith("toolu_")
            blocks.append(("tool_use", b.name, b.input))
    return {"blocks": blocks, "stop_reason": message.stop_reason,
            "stop_sequence": message.stop_sequence, "id": message.id}


def test_a_tool_call_is_a_tool_use_block_created_and_streamed() -> None:
    client = scripted(HERMES_CALL, **AUTO_TOOLS)
    for r in both(client, tools=[WEATHER]):
        assert r["blocks"] == [("text", "Let me check. "),
                               ("tool_use", "get_weather", {"city": "Paris"})]
        assert r["stop_reason"] == "tool_use" and r["id"].startswith("msg_")
    # the template saw the tools as OpenAI functions
    assert client.engine.tokenizer.template_calls[-1]["tools"] == [{
        "type": "function", "function": {"name": "get_weather",
                                         "description": WEATHER["description"],
                                         "parameters": WEATHER["input_schema"]}}]


def test_a_plain_answer_ends_the_turn() -> None:
    client = scripted(["It is ", "sunny."])
    for r in both(client):
        assert r["blocks"] == [("text", "It is sunny.")]
        assert r["stop_reason"] == "end_turn" and r["stop_sequence"] is None


def test_max_tokens_is_the_stop_reason_when_it_cuts() -> None:
    client = scripted(None)  # the letters engine: max_tokens letters, then "length"
    for r in both(client, max_tokens=3):
        assert r["blocks"] == [("text", "abc")] and r["stop_reason"] == "max_tokens"
    assert client.engine.submitted[-1][2].max_tokens == 3


def test_the_tool_round_trip_reaches_the_template() -> None:
    """tool_use and tool_result blocks (a content list, is_error) become the assistant's
    tool_calls and tool messages; system blocks the system message."""
    client = scripted(["It is 18 ", "degrees."], **AUTO_TOOLS)
    history = [*ASK,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "I should look.", "signature": "s"},
                   {"type": "text", "text": "Checking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Paris"}},
                   {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                    "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 C"}, {"type": "text",
                                                                   "text": "sunny"}]},
                   {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no station",
                    "is_error": True},
                   {"type": "text", "text": "And so?"}]}]
    reply = client.messages.create(model="fake-model", max_tokens=50, tools=[WEATHER],
                                   system=[{"type": "text", "text": "Be brief."},
                                           {"type": "text", "text": "Use tools."}],
                                   messages=history)
    assert reading(reply)["blocks"] == [("text", "It is 18 degrees.")]
    assert reply.stop_reason == "end_turn"
    seen = client.engine.tokenizer.template_calls[-1]["messages"]
    assert seen == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should look.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "toolu_2", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C\nsunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": "And so?"}]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function",
                                               "function": {"name": "get_weather"}}),
    ({"type": "none"}, "none"),
])
def test_tool_choice_maps_to_the_chat_choice(choice: dict, expected: object) -> None:
    """any / tool are enforced by the chat path's grammar; none keeps the tools in the
    prompt and the answer in text."""
    client = scripted(['{"city": "Paris"}'] if choice["type"] == "tool" else
                      ['[{"name": "get_weather", "parameters": {"city": "Paris"}}]']
                      if choice["type"] == "any" else ["Sunny."])
    reply = client.messages.create(model="fake-model", max_tokens=50, messages=ASK,
                                   tools=[WEATHER], tool_choice=choice)
    params = client.engine.submitted[-1][2]
    if choice["type"] == "none":
        assert params.structured_outputs is None
        assert reading(reply)["blocks"] == [("text", "Sunny.")]
    else:
        assert params.structured_outputs is not None and params.structured_outputs.json
        assert reading(reply)["blocks"] == [("tool_use", "get_weather", {"city": "Paris"})]
        assert reply.stop_reason == "tool_use"
    assert client.engine.tokenizer.template_calls[-1]["tools"]


def test_sampling_fields_reach_the_engine() -> None:
    client = scripted(["ok"])
    client.messages.create(model="fake-model", max_tokens=7, messages=ASK,
                           stop_sequences=["END", "STOP"], metadata={"user_id": "u1"},
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    params = client.engine.submitted[-1][2]
    assert (params.max_tokens, params.stop, params.temperature, params.top_p, params.top_k) \
        == (7, ["END", "STOP"], 0.5, 0.9, 5)


def test_a_last_assistant_turn_is_continued() -> None:
    """Anthropic's prefill: the answer goes on from the assistant's text."""
    client = scripted(["lo"])
    client.messages.create(model="fake-model", max_tokens=5, messages=[
        *ASK, {"role": "assistant", "content": "Hel"}])
    prompt = client.engine.submitted[-1][1]
    text = "".join(map(chr, prompt))
    assert text.endswith("|Hel")


@pytest.mark.parametrize("display, shown", [(None, True), ("omitted", False)])
def test_thinking_becomes_a_thinking_block(display: str | None, shown: bool) -> None:
    client = scripted(["Paris is ", "in France.</th", "ink>", "It is sunny."],
                      reasoning_parser="deepseek_r1")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    if display:
        thinking["display"] = display
    for r in both(client, thinking=thinking, max_tokens=2000):
        assert r["blocks"] == [("thinking", "Paris is in France." if shown else ""),
                               ("text", "It is sunny.")]


def test_thinking_then_a_tool_call() -> None:
    client = scripted(["I should look ", "it up.</think>", *HERMES_CALL[1:]],
                      reasoning_parser="deepseek_r1", **AUTO_TOOLS)
    for r in both(client, tools=[WEATHER]):
        assert r["blocks"] == [("thinking", "I should look it up."),
                               ("tool_use", "get_weather", {"city": "Paris"})]
        assert r["stop_reason"] == "tool_use"


def test_the_stream_has_anthropics_events_in_order() -> None:
    client = scripted(["Hi", " there"])
    with client.messages.with_streaming_response.create(
            model="fake-model", max_tokens=10, messages=ASK, stream=True) as response:
        body = response.read().decode()
    names = [line[len("event: "):] for line in body.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [json.loads(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's data names it too
    assert data[0]["message"]["usage"]["input_tokens"] > 0
    assert data[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 2


def test_count_tokens_counts_what_create_prompts() -> None:
    client = scripted(["ok"], **AUTO_TOOLS)
    fields = dict(model="fake-model", system="Be brief.", tools=[WEATHER], messages=ASK)
    counted = client.messages.count_tokens(**fields).input_tokens
    reply = client.messages.create(max_tokens=5, **fields)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert counted == len(client.engine.submitted[-1][1])
    assert client.engine.tokenizer.template_calls[-1]["tools"]  # tools are in the count


# --- refusals and errors, in Anthropic's shape -------------------------------------------

@pytest.mark.parametrize("fields, chat, param", [
    ({"extra_body": {"temperature": 1.5}}, {}, "temperature"),
    ({"max_tokens": 0}, {}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {}, "thinking"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 4096},
     {"reasoning_parser": "deepseek_r1"}, "thinking.budget_tokens"),
    ({"tools": [WEATHER]}, {}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, {},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, {}, "images are not supported"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, {},
     "messages.0.content.0"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, {},
     "mcp_servers"),
])
def test_requests_that_cannot_be_served_raise_bad_request(fields: dict, chat: dict,
                                                          param: str) -> None:
    client = scripted(["x"], **chat)
    kwargs = {"model": "fake-model", "max_tokens": 10, "messages": ASK, **fields}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**kwargs)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"], body
    assert not client.engine.submitted  # refused before it reached the engine


def sdk(failure: BaseException | None = None, **settings: object) -> anthropic.Anthropic:
    app = build_app(StubEngine(failure), ServerConfig(**settings))
    return anthropic.Anthropic(base_url="http://testserver", api_key="k", max_retries=0,
                               http_client=TestClient(app))


@pytest.mark.parametrize("make, fields, exc_type, status, kind", [
    (lambda: sdk(), {"model": "claude-9"}, anthropic.NotFoundError, 404, "not_found_error"),
    (lambda: sdk(api_key="secret"), {}, anthropic.AuthenticationError, 401,
     "authentication_error"),
    (lambda: sdk(max_body_bytes=64), {"system": "x" * 100}, anthropic.APIStatusError, 413,
     "request_too_large"),
    (lambda: sdk(RequestFailedError("r1", "boom")), {}, anthropic.InternalServerError, 500,
     "api_error"),
    (lambda: sdk(EngineDeadError("engine is not running")), {},
     anthropic.InternalServerError, 503, "overloaded_error"),
])
def test_each_status_raises_its_sdk_exception(make, fields: dict, exc_type: type,
                                              status: int, kind: str) -> None:
    client = make()
    with pytest.raises(exc_type) as info:
        client.messages.create(**{"model": "m", "max_tokens": 5, "messages": ASK, **fields})
    err = info.value
    assert err.status_code == status and isinstance(err, exc_type)
    assert err.body["type"] == "error" and err.body["error"]["type"] == kind
    assert err.body["error"]["message"] and err.body["request_id"] == err.request_id


def test_x_api_key_is_accepted_beside_the_bearer_key() -> None:
    client = scripted(["ok"], api_key="secret")
    assert client.messages.create(model="fake-model", max_tokens=5, messages=ASK).content
    with pytest.raises(anthropic.AuthenticationError):
        client.with_options(api_key="wrong").messages.create(
            model="fake-model", max_tokens=5, messages=ASK)
    http = client._client  # the same app, by hand: bearer, x-api-key, neither
    body = {"model": "fake-model", "max_tokens": 5, "messages": ASK}
    assert http.post("/v1/messages", json=body,
                     headers={"Authorization": "Bearer secret"}).status_code == 200
    assert http.post("/v1/chat/completions", json={"model": "fake-model", "messages": ASK},
                     headers={"x-api-key": "secret"}).status_code == 200
    refused = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": ASK},
                        headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and "error" in refused.json()  # OpenAI's shape there


def test_a_failure_mid_stream_is_an_error_event() -> None:
    class FailingLater(FakeEngine):
        async def _outputs(self, request_id, prompt, params):
            async for out in super()._outputs(request_id, prompt, params):
                yield out
                raise RequestFailedError(request_id, "the device fell over")

    app = build_app(FailingLater(["a", "b", "c"]), ServerConfig())
    client = anthropic.Anthropic(base_url="http://testserver", api_key="k", max_retries=0,
                                 http_client=TestClient(app))
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(model="fake-model", max_tokens=5, messages=ASK) as s:
            s.get_final_message()
    assert info.value.body["error"]["type"] == "api_error"
    assert "the device fell over" in info.value.body["error"]["message"]


def test_the_openapi_document_declares_anthropics_shapes() -> None:
    app = build_app(FakeEngine(["x"]), ServerConfig())
    doc = TestClient(app)
    paths = doc.get("/openapi.json").json()["paths"]
    post = paths["/v1/messages"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/MessagesRequest")
    assert set(post["responses"]["200"]["content"]) == {"application/json",
                                                        "text/event-stream"}
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"] \
        .endswith("/AnthropicErrorResponse")
    assert "/v1/messages/count_tokens" in paths
