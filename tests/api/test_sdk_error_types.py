"""Every error status the server sends maps to the ``openai`` SDK's exception for it.

The real SDK talks to the app in process (a TestClient is an httpx client), with an engine
stub that can fail the ways the real one does; no model is needed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from server.api.app import build_app
from server.config import ServerConfig
from server.engine.errors import EngineDeadError, RequestFailedError
from server.engine.sampling_defaults import NO_DEFAULTS

MSG = [{"role": "user", "content": "hi"}]


class StubEngine:
    """Fails every submission with ``failure`` (or never answers when None)."""

    model_name = "m"
    max_model_len = 64
    pooling = None  # a generative engine
    vision = None  # a text-only one
    sampling_defaults = NO_DEFAULTS

    def __init__(self, failure: BaseException | None) -> None:
        self.failure = failure
        self.is_alive = True
        self.tokenizer = SimpleNamespace(vocab_size=100, encode_chat=lambda *_: [1, 2, 3],
                                         apply_chat_template=lambda *_: "abc",
                                         encode=lambda *_, **__: [1, 2, 3],
                                         max_token_bytes=None, token_str=str)
        self.metrics_registry = CollectorRegistry()

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def submit(self, request_id: str, prompt: object, params: object = None,
                     client: str = "", offload: object = None,
                     lora_request: object = None) -> AsyncIterator[object]:
        assert self.failure is not None
        raise self.failure

    def abort(self, request_id: str) -> None:
        pass

    def lora_adapter(self, name: str) -> None:
        return None

    def stalled_for(self) -> float:
        return 0.0

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                               num_preemptions=0)


def sdk(failure: BaseException | None = None, **settings: object) -> openai.OpenAI:
    app = build_app(StubEngine(failure), ServerConfig(**settings))
    # max_retries=0: the SDK retries 5xx by itself; here each status must surface once
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                         http_client=TestClient(app))


@pytest.mark.parametrize("make, fields, exc_type, status", [
    (lambda: sdk(), {"temperature": 3}, openai.BadRequestError, 400),
    (lambda: sdk(), {"extra_body": {"tools": [{"type": "function"}]}},
     openai.BadRequestError, 400),
    (lambda: sdk(api_key="secret"), {}, openai.AuthenticationError, 401),
    (lambda: sdk(), {"model": "gpt-9"}, openai.NotFoundError, 404),
    (lambda: sdk(max_body_bytes=64), {"extra_body": {"user": "x" * 100}},
     openai.APIStatusError, 413),
    (lambda: sdk(RequestFailedError("r1", "boom")), {}, openai.InternalServerError, 500),
    (lambda: sdk(EngineDeadError("engine is not running")), {},
     openai.InternalServerError, 503),
])
def test_each_status_raises_its_sdk_exception(make, fields: dict, exc_type: type,
                                              status: int) -> None:
    client = make()
    kwargs = {"model": "m", "messages": MSG, **fields}
    with pytest.raises(exc_type) as info:
        client.chat.completions.create(**kwargs)
    err = info.value
    assert err.status_code == status
    if status != 413:  # 413 has no dedicated class in the SDK: APIStatusError is its base
        assert type(err) is exc_type
    assert err.message and err.body is not None and err.body["type"]  # the SDK read the body
    assert isinstance(err.response.json()["error"]["code"], str)  # OpenAI: string or null
