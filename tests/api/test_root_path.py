"""--root-path (vLLM's): behind a proxy that keeps its prefix, routes answer under it and
without it, and the API key guards both spellings."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

KEY = "abc-123"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--root-path", "/llm", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_routes_answer_with_and_without_the_prefix(server, prefix: str) -> None:
    base = f"{server.base_url}{prefix}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert reply.choices[0].message.content is not None
    unguarded = httpx.get(f"{server.base_url}{prefix}/health", timeout=30)
    assert unguarded.status_code == 200


def test_the_openapi_document_names_the_prefix(server) -> None:
    doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert doc["servers"] == [{"url": "/llm"}]
