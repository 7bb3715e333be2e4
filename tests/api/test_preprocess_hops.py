"""A request crosses to a worker thread once before it is queued: its prompt is built (chat
template, tokenizing) and checked by the engine in one job on the preprocess pool, in the
client's share. The real engine (tiny model) behind the real app, with every hop counted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.api.app import build_app
from server.api.workers import PreprocessPool
from server.config import ServerConfig, make_engine_config
from server.engine.async_engine import AsyncEngine

Hop = tuple[str, str]  # (through what, the job's name)


@pytest.fixture(scope="module")
def client(tiny_model) -> Iterator[TestClient]:
    config = make_engine_config(model=tiny_model[0], dtype="float32", block_size=16,
                                max_model_len=256)
    with TestClient(build_app(AsyncEngine.from_config(config), ServerConfig())) as client:
        yield client


@pytest.fixture()
def hops(monkeypatch: pytest.MonkeyPatch) -> list[Hop]:
    """Every job sent to a thread from now on: the preprocess pool's and asyncio's."""
    seen: list[Hop] = []
    pool_run = PreprocessPool.run
    to_thread = asyncio.to_thread

    async def counted_run(self: PreprocessPool, client: str, fn: Callable[..., Any],
                          *args: Any) -> Any:
        seen.append(("pool", fn.__name__))
        return await pool_run(self, client, fn, *args)

    async def counted_to_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        seen.append(("to_thread", fn.__name__))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(PreprocessPool, "run", counted_run)
    monkeypatch.setattr(asyncio, "to_thread", counted_to_thread)
    return seen


CHAT = {"messages": [{"role": "user", "content": "the quick brown fox"}]}
REQUESTS = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat with a grammar": ("/v1/chat/completions",
                            {**CHAT, "response_format": {"type": "json_object"}}),
    "completion": ("/v1/completions", {"prompt": "the quick brown fox"}),
    "completion of token ids": ("/v1/completions", {"prompt": [5, 6, 7, 8]}),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_a_request_makes_one_preprocessing_hop(client: TestClient, hops: list[Hop],
                                               name: str) -> None:
    path, body = REQUESTS[name]
    # streamed: no answer to serialize on a worker afterwards
    resp = client.post(path, json={"max_tokens": 3, "stream": True, **body})
    assert resp.status_code == 200, resp.text
    assert resp.text.rstrip().endswith("data: [DONE]")
    # a small body parses on the loop; the prompt's build and the engine's checks are one
    # job, in the client's share of the pool (a grammar compiles in the compile pool, which
    # is no preprocessing thread)
    assert len(hops) == 1, hops
    assert hops[0][0] == "pool", hops


def test_a_large_body_is_parsed_on_the_pool(client: TestClient, hops: list[Hop]) -> None:
    """Parsing grows with the body: past a few KiB it leaves the event loop."""
    body = {"messages": [{"role": "user", "content": "fox " * 4000}], "max_tokens": 1,
            "stream": True}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code in (200, 400), resp.text
    assert hops[0] == ("pool", "_decode"), hops


@pytest.mark.parametrize("prompt", ["fox " * 400, [5] * 400], ids=["text", "token ids"])
def test_a_prompt_beyond_the_context_is_refused_in_that_one_hop(
        client: TestClient, hops: list[Hop], prompt: str | list[int]) -> None:
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert resp.status_code == 400, resp.text
    assert "maximum context length" in resp.json()["error"]["message"]
    assert len(hops) == 1, hops
