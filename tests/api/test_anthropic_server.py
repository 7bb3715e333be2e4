"""The Messages API on a real server, through the official ``anthropic`` SDK: the embedded
SmolLM2 behind hermes tool calling (its ChatML with tools), and a tiny model behind
``--api-key``. The grammar-enforced choices (``any``, a named tool) make the calls valid
whatever the small model would write."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

pytestmark = pytest.mark.slow  # a real model's server and generation

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent(smollm2_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smollm2_server.base_url, api_key="unused",
                               max_retries=0)


def uncached(server) -> None:
    """Forgets cached prefixes: a prefill over a cached prefix rounds differently, which can
    flip a greedy token; requests compared token for token start cold."""
    httpx.post(server.base_url + "/reset_prefix_cache", timeout=30).raise_for_status()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(agent, stream: bool) -> None:
    """tool_use -> the tool's tool_result -> the answer, created or streamed."""
    fields = dict(model=MODEL_NAME, tools=[WEATHER], extra_body={"temperature": 0.0})

    def ask(max_tokens: int = 120, **more) -> anthropic.types.Message:
        if not stream:
            return agent.messages.create(max_tokens=max_tokens, **fields, **more)
        with agent.messages.stream(max_tokens=max_tokens, **fields, **more) as events:
            return events.get_final_message()

    first = ask(messages=ASK, tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use", first
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls and all(c.name == "get_weather" and c.id.startswith("toolu_") for c in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": c.id,
                    "content": [{"type": "text", "text": "18 C and sunny"}]} for c in calls]}]
    final = ask(messages=history, tool_choice={"type": "none"}, max_tokens=30)
    assert final.stop_reason in ("end_turn", "max_tokens")
    texts = [b.text for b in final.content if b.type == "text"]
    assert texts and texts[0].strip() and not any(b.type == "tool_use" for b in final.content)
    # the call and its result were in the prompt count_tokens renders, as create did
    with_result = agent.messages.count_tokens(model=MODEL_NAME, tools=[WEATHER],
                                              messages=history).input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == with_result


def test_a_named_tool_is_called(agent) -> None:
    reply = agent.messages.create(model=MODEL_NAME, max_tokens=120, messages=ASK,
                                  tools=[WEATHER], tool_choice={"type": "tool",
                                                                "name": "get_weather"})
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert reply.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(smollm2_server, agent, stream: bool) -> None:
    """A word the model writes (greedy) ends the answer when it is a stop sequence."""
    fields = dict(model=MODEL_NAME, max_tokens=24, extra_body={"temperature": 0.0},
                  messages=[{"role": "user", "content": "Tell me about the sea."}])
    uncached(smollm2_server)
    free = agent.messages.create(**fields)
    text = free.content[0].text
    words = text.split()
    assert len(words) > 4, text
    stop = " " + words[3]
    uncached(smollm2_server)
    if stream:
        with agent.messages.stream(stop_sequences=[stop, "never-written"], **fields) as s:
            reply = s.get_final_message()
    else:
        reply = agent.messages.create(stop_sequences=[stop, "never-written"], **fields)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == text[:text.index(stop)]


def test_count_tokens_is_the_prompt_a_create_reports(smollm2_server, agent) -> None:
    fields = dict(model=MODEL_NAME, system="You are terse.", tools=[WEATHER],
                  messages=[*ASK, {"role": "assistant", "content": [
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                       "input": {"city": "Paris", "unit": "celsius"}}]},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": "toolu_1",
                                                    "content": "18 C"}]}])
    counted = agent.messages.count_tokens(**fields).input_tokens
    uncached(smollm2_server)
    cold = agent.messages.create(max_tokens=5, tool_choice={"type": "none"}, **fields)
    assert (cold.usage.input_tokens, cold.usage.cache_read_input_tokens) == (counted, 0)
    warm = agent.messages.create(max_tokens=5, tool_choice={"type": "none"}, **fields)
    # the prefix cache served part of the same prompt: Anthropic counts it apart
    assert warm.usage.cache_read_input_tokens > 0
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == counted


def test_a_bad_request_raises_bad_request_error(agent) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        agent.messages.create(model=MODEL_NAME, max_tokens=10, messages=ASK,
                              thinking={"type": "enabled", "budget_tokens": 2048})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "--reasoning-parser" in info.value.body["error"]["message"]


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--api-key", "secret")
    yield srv
    srv.stop()


def test_x_api_key(keyed_server) -> None:
    good = anthropic.Anthropic(base_url=keyed_server.base_url, api_key="secret",
                               max_retries=0)
    reply = good.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK)
    assert reply.usage.output_tokens == 3 and reply.stop_reason == "max_tokens"
    assert reply._request_id  # Anthropic's request-id header
    bad = anthropic.Anthropic(base_url=keyed_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=MODEL_NAME, messages=ASK)
