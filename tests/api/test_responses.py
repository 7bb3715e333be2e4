"""The Responses API (/v1/responses) through the openai SDK, on a scripted engine: the event
sequence, output items (text, reasoning, function calls), the conversation that
previous_response_id carries, the store's bounds and its 404s, and the 400s for what this
server cannot honour. The real-model runs are in test_responses_server.py."""

from __future__ import annotations

import json

import openai
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from server.api.app import build_app
from server.api.errors import APIError
from server.api.responses.protocol import ResponseObject, ResponseStatus
from server.api.responses.store import ResponseStore, StoredResponse
from server.config import ChatOptions, ResponsesStoreConfig, ServerConfig

HERMES_CALL = ["Let me check. ", "<tool", "_call>\n", '{"name": "get_weather", ',
               '"arguments": {"city": "Pa', 'ris"}}', "\n</tool_call>"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def sdk(script: list[str] | None = None, store: ResponsesStoreConfig | None = None,
        **chat: object) -> openai.OpenAI:
    engine = FakeEngine(script)
    config = ServerConfig(chat=ChatOptions(**chat), responses=store or ResponsesStoreConfig())
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                           http_client=TestClient(build_app(engine, config)))
    client.engine = engine  # type: ignore[attr-defined]
    return client


def events_of(stream) -> list:
    events = list(stream)
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)), "sequence_number strictly increases"
    return events


def test_text_answer_whole_and_streamed_agree() -> None:
    client = sdk(["Hello", " there", "."])
    whole = client.responses.create(model="fake-model", input="Hi", instructions="Be brief.")
    assert whole.status == "completed" and whole.output_text == "Hello there."
    assert whole.usage.output_tokens == 3 and whole.usage.input_tokens > 0
    assert whole.usage.input_tokens_details.cached_tokens == 0
    # instructions came first, as a system message
    messages = client.engine.tokenizer.template_calls[-1]["messages"]
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"}]
    events = events_of(client.responses.create(model="fake-model", input="Hi", stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Hello there."
    assert events[-1].response.output_text == "Hello there."
    assert events[-1].response.usage.output_tokens == 3
    # the SDK's own accumulator agrees
    with client.responses.stream(model="fake-model", input="Hi") as stream:
        assert stream.get_final_response().output_text == "Hello there."


def test_max_output_tokens_makes_it_incomplete() -> None:
    client = sdk()  # the letters engine stops on length
    response = client.responses.create(model="fake-model", input="Hi", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "abc"
    assert client.engine.submitted[-1][2].max_tokens == 3
    events = events_of(client.responses.create(model="fake-model", input="Hi",
                                               max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_call_is_a_function_call_item(stream: bool) -> None:
    client = sdk(HERMES_CALL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    if stream:
        events = events_of(client.responses.create(model="fake-model", input="Weather?",
                                                   tools=[WEATHER], stream=True))
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
        assert json.loads(args) == {"city": "Paris"}
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == args
        output = events[-1].response.output
    else:
        output = client.responses.create(model="fake-model", input="Weather?",
                                         tools=[WEATHER]).output
    assert [item.type for item in output] == ["message", "function_call"]
    assert output[0].content[0].text == "Let me check. "
    call = output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call")
    # the tools reached the template in chat's form
    assert client.engine.tokenizer.template_calls[-1]["tools"][0]["function"]["name"] == \
        "get_weather"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_an_output_item(stream: bool) -> None:
    client = sdk(["<think>", "Paris is ", "in France.", "</think>", "Sunny."],
                 reasoning_parser="qwen3")
    if stream:
        events = events_of(client.responses.create(model="fake-model", input="Hi",
                                                   stream=True))
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_text.done") < \
            kinds.index("response.output_text.delta")
        response = events[-1].response
    else:
        response = client.responses.create(model="fake-model", input="Hi")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Paris is in France."
    assert response.output_text.strip() == "Sunny."
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_previous_response_id_carries_the_conversation() -> None:
    client = sdk(HERMES_CALL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    first = client.responses.create(model="fake-model", input="Weather in Paris?",
                                    instructions="Old instructions.", tools=[WEATHER])
    call = first.output[1]
    client.responses.create(model="fake-model", previous_response_id=first.id,
                            instructions="New instructions.", tools=[WEATHER],
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "18 C"}])
    messages = client.engine.tokenizer.template_calls[-1]["messages"]
    assert messages[0] == {"role": "system", "content": "New instructions."}  # not carried
    assert messages[1] == {"role": "user", "content": "Weather in Paris?"}
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "Let me check. "
    assert messages[2]["tool_calls"][0]["id"] == call.call_id
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}


def test_input_items_become_chat_messages() -> None:
    client = sdk(["ok"])
    client.responses.create(model="fake-model", input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ])
    messages = client.engine.tokenizer.template_calls[-1]["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    assert messages[1]["content"] == "Hello"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]


def test_json_schema_format_becomes_the_constraint() -> None:
    client = sdk(['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(model="fake-model", input="Hi", text={"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert client.engine.submitted[-1][2].structured_outputs.json_schema == schema
    client.responses.create(model="fake-model", input="Hi",
                            text={"format": {"type": "json_object"}})
    assert client.engine.submitted[-1][2].structured_outputs.json_object


def test_retrieve_and_store_false() -> None:
    client = sdk(["ok"])
    kept = client.responses.create(model="fake-model", input="Hi", metadata={"k": "v"})
    again = client.responses.retrieve(kept.id)
    assert again.output_text == "ok" and again.metadata == {"k": "v"}
    assert again.status == "completed"
    gone = client.responses.create(model="fake-model", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(gone.id)


def test_eviction_is_explained_unlike_an_unknown_id() -> None:
    client = sdk(["ok"], store=ResponsesStoreConfig(max_entries=2, ttl_s=60))
    ids = [client.responses.create(model="fake-model", input="Hi").id for _ in range(3)]
    client.responses.retrieve(ids[1])
    client.responses.retrieve(ids[2])  # the newest two are kept
    with pytest.raises(openai.NotFoundError) as evicted:
        client.responses.retrieve(ids[0])
    message = evicted.value.body["message"]
    assert f"response {ids[0]} was evicted" in message and "capacity 2" in message
    assert "TTL 60 s" in message
    with pytest.raises(openai.NotFoundError) as evicted:  # also as a previous response
        client.responses.create(model="fake-model", input="Hi", previous_response_id=ids[0])
    assert "was evicted" in evicted.value.body["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.retrieve("resp_never")
    assert "not found" in unknown.value.body["message"]
    assert "evicted" not in unknown.value.body["message"]


def test_store_ttl_counts_from_the_finish() -> None:
    now = [0.0]
    store = ResponseStore(ResponsesStoreConfig(max_entries=5, ttl_s=10), clock=lambda: now[0])

    def entry(rid: str, status: ResponseStatus) -> StoredResponse:
        return StoredResponse(ResponseObject(id=rid, created_at=0, status=status, model="m"))

    running = entry("resp_run", ResponseStatus.IN_PROGRESS)
    store.put(entry("resp_done", ResponseStatus.COMPLETED))
    store.put(running)
    now[0] = 9.0
    store.get("resp_done")
    now[0] = 11.0
    with pytest.raises(APIError, match="expired"):
        store.get("resp_done")
    store.get("resp_run")  # running: never evicted
    running.response = running.response.model_copy(update={"status": ResponseStatus.COMPLETED})
    store.finished(running)
    now[0] = 20.0
    store.get("resp_run")  # 9 s after its finish
    now[0] = 21.5
    with pytest.raises(APIError, match="expired"):
        store.get("resp_run")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1]"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]}, "tools[0]"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools[0]"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"background": True, "store": False}, "background"),
    ({"background": True, "stream": True}, "stream"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice
])
def test_what_cannot_be_honoured_is_400_naming_it(fields: dict, param: str) -> None:
    client = sdk(["ok"])
    body = {"model": "fake-model", "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=object)
    assert refused.value.body["param"] == param, refused.value.body
    assert not client.engine.submitted


def test_unknown_fields_are_ignored_as_in_chat() -> None:
    client = sdk(["ok"])
    response = client.post("/responses", body={"model": "fake-model", "input": "Hi",
                                                "service_tier": "auto", "no_such": 1},
                           cast_to=object)
    assert response["status"] == "completed"


def test_cancel_needs_a_background_response() -> None:
    client = sdk(["ok"])
    plain = client.responses.create(model="fake-model", input="Hi")
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_never")
