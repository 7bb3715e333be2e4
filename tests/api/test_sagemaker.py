"""SageMaker's routes, as vLLM serves them: /ping is the health check, /invocations takes a
chat body (with messages) or a completion body."""

from __future__ import annotations

import httpx
import pytest
from server_process import MODEL_NAME


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_the_health_check(server, method: str) -> None:
    resp = httpx.request(method, server.base_url + "/ping", timeout=30)
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_invocations_serves_chat_and_completions_like_their_routes(server) -> None:
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0}
    text = {"model": MODEL_NAME, "prompt": "the quick", "max_tokens": 4, "temperature": 0}
    for body, route, kind in ((chat, "/v1/chat/completions", "chat.completion"),
                              (text, "/v1/completions", "text_completion")):
        via = httpx.post(server.base_url + "/invocations", json=body, timeout=60).json()
        direct = httpx.post(server.base_url + route, json=body, timeout=60).json()
        assert via["object"] == kind
        assert via["choices"] == direct["choices"]  # greedy: the same answer
        assert via.keys() == direct.keys()  # vLLM's test_invocations compares the keys


def test_a_bad_invocation_names_the_field(server) -> None:
    resp = httpx.post(server.base_url + "/invocations", json={"messages": []}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages", resp.text
