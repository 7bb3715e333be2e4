"""The serving layer alone, over a scripted engine: choice indexing, echo, logprob offsets,
usage, streamed vs non-streamed. Fast (no model), so every detail gets its own test."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, expected_text
from fastapi.testclient import TestClient

from server.api.app import build_app
from server.config import ServerConfig


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine: FakeEngine):
    with TestClient(build_app(engine, ServerConfig())) as client:
        yield client


def sse_events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def completion(client: TestClient, **body) -> dict:
    resp = client.post("/v1/completions", json={"model": "fake-model", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_chat_content_and_usage(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["content"] == expected_text(5, 0)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_n_times_prompts_choices_are_indexed_prompt_major(client: TestClient) -> None:
    body = completion(client, prompt=["ab", "cde"], n=2, max_tokens=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # choice prompt * n + i holds completion i of that prompt
    assert [c["text"] for c in body["choices"]] == [expected_text(3, i % 2) for i in range(4)]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_streamed_choices_match_non_streamed(client: TestClient) -> None:
    whole = completion(client, prompt=["ab", "cde"], n=2, max_tokens=4)
    resp = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2,
                                                 "max_tokens": 4, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert set(reasons.values()) == {"length"}
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == whole["usage"]


def test_echo_prefixes_the_prompt_once(client: TestClient) -> None:
    body = completion(client, prompt="ab", echo=True, max_tokens=3)
    assert body["choices"][0]["text"] == "ab" + expected_text(3, 0)
    resp = client.post("/v1/completions", json={"prompt": "ab", "echo": True, "max_tokens": 3,
                                                 "stream": True})
    streamed = "".join(c["text"] for e in sse_events(resp.text) for c in e["choices"])
    assert streamed == "ab" + expected_text(3, 0)


def test_echo_of_token_ids_decodes_them(client: TestClient) -> None:
    body = completion(client, prompt=[ord("x"), ord("y")], echo=True, max_tokens=2)
    assert body["choices"][0]["text"] == "xy" + expected_text(2, 0)


def test_completion_logprob_offsets_run_across_the_text(client: TestClient) -> None:
    body = completion(client, prompt="ab", max_tokens=4, logprobs=1)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == list(expected_text(4, 0))
    assert logprobs["text_offset"] == [0, 1, 2, 3]
    assert logprobs["token_logprobs"] == [-0.5] * 4
    assert logprobs["top_logprobs"] == [{t: -0.5} for t in expected_text(4, 0)]


def test_streamed_logprob_offsets_continue_across_chunks(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4,
                                                 "logprobs": 2, "stream": True})
    offsets = [o for e in sse_events(resp.text) for c in e["choices"]
               for o in c["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


def test_chat_logprobs_carry_token_bytes_and_alternatives(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
        "top_logprobs": 2})
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == list(expected_text(2, 0))
    assert content[0]["bytes"] == [ord("a")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "z"]


def test_chat_stream_starts_with_the_role_and_counts_usage(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(resp.text)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}]
    texts = {0: "", 1: ""}
    for event in events[2:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: expected_text(3, 0), 1: expected_text(3, 1)}
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_params_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    completion(client, prompt="ab", max_tokens=2, temperature=0.5, top_k=7, seed=3,
               stop=["x"], min_tokens=1)
    _, prompt, params = engine.submitted[-1]
    assert prompt == [97, 98]  # tokenized by the API (its pool), not the engine
    assert (params.temperature, params.top_k, params.seed) == (0.5, 7, 3)
    assert (params.stop, params.min_tokens, params.max_tokens) == (["x"], 1, 2)
