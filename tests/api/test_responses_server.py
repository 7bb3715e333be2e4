"""/v1/responses on a real server with the embedded SmolLM2, through the openai SDK: text
(whole and streamed), json_schema output valid against its schema, a forced function call
answered after its output is sent with previous_response_id, retrieve, and a background
response cancelled with its engine request aborted."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                     "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.base_url + "/v1", api_key="unused",
                         max_retries=0)


# over one KV block (128 tokens): asked twice, its first block comes from the prefix cache
LONG = "The sky is blue and the grass is green. " * 30 + "Say hello."


def test_create_whole_and_streamed(client) -> None:
    whole = client.responses.create(model=MODEL, input=LONG, max_output_tokens=20,
                                    temperature=0.0)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 20
    events = list(client.responses.create(model=MODEL, input=LONG,
                                          max_output_tokens=20, temperature=0.0,
                                          stream=True))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text  # greedy: the same answer
    # the same prompt again: its prefix came from the cache
    assert events[-1].response.usage.input_tokens_details.cached_tokens >= 128


def test_json_schema_output_is_valid(client) -> None:
    # Every field bounded, so that any sample ends within max_output_tokens: an unbounded
    # integer at temperature 1 ran to 100 digits for 2 seeds in 8.
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Invent a person.", max_output_tokens=100, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_forced_call_then_its_output_with_previous_response_id(client, smollm2_server) -> None:
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], max_output_tokens=60, temperature=0.0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        max_output_tokens=40, temperature=0.0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "18 C and sunny"}])
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    assert answer.previous_response_id == first.id
    # the earlier question, the call and its output were all in the prompt
    assert answer.usage.input_tokens > first.usage.input_tokens + 10
    assert client.responses.retrieve(answer.id).output_text == answer.output_text


def test_background_then_cancel_frees_the_request(client, smollm2_server) -> None:
    created = client.responses.create(model=MODEL, input="Write a very long story.",
                                      background=True, max_output_tokens=900,
                                      extra_body={"ignore_eos": True})
    assert created.status in ("queued", "in_progress") and created.background
    deadline = time.monotonic() + 60
    while client.responses.retrieve(created.id).status == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert smollm2_server.metric("vllm:num_requests_running") >= 1
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # idempotent
    deadline = time.monotonic() + 30
    while smollm2_server.metric("vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.05)


def test_background_runs_to_completion(client) -> None:
    created = client.responses.create(model=MODEL, input="Say hi.", background=True,
                                      max_output_tokens=10, temperature=0.0)
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(created.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status in ("completed", "incomplete") and got.output_text
    with pytest.raises(openai.BadRequestError, match="already finished"):
        client.responses.cancel(created.id)


def test_built_in_tools_are_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Search.", tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools[0]"
    assert "web_search" in refused.value.body["message"]
