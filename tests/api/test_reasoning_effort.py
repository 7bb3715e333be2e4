"""reasoning_effort (chat) and reasoning.effort (Responses) reach the chat template as its
``reasoning_effort`` variable, as vLLM hands them over (vLLM's responses tests send
reasoning={"effort": ...} and expect a completed response, not a 400)."""

from __future__ import annotations

import openai
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from server.api.app import build_app
from server.config import ServerConfig


@pytest.fixture
def client() -> openai.OpenAI:
    engine = FakeEngine(["ok"])
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                        http_client=TestClient(build_app(engine, ServerConfig())))
    sdk.engine = engine  # type: ignore[attr-defined]
    return sdk


def template_kwargs(client: openai.OpenAI) -> dict | None:
    return client.engine.tokenizer.template_calls[-1]["template_kwargs"]  # type: ignore


def test_chat_reasoning_effort_reaches_the_template(client) -> None:
    client.chat.completions.create(model="fake-model", reasoning_effort="low",
                                   messages=[{"role": "user", "content": "hi"}])
    assert template_kwargs(client) == {"reasoning_effort": "low"}
    client.chat.completions.create(model="fake-model", reasoning_effort="high",
                                   messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"chat_template_kwargs": {"x": 1}})
    assert template_kwargs(client) == {"x": 1, "reasoning_effort": "high"}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="fake-model", messages=[
            {"role": "user", "content": "hi"}], extra_body={"reasoning_effort": "extreme"})
    assert bad.value.body["param"] == "reasoning_effort"


def test_responses_reasoning_effort_reaches_the_template(client) -> None:
    response = client.responses.create(model="fake-model", input="hi",
                                       reasoning={"effort": "none"})
    assert response.status == "completed"
    assert template_kwargs(client) == {"reasoning_effort": "none"}
    with pytest.raises(openai.BadRequestError) as bad:  # summaries are not made here
        client.responses.create(model="fake-model", input="hi", reasoning={"summary": "auto"})
    assert bad.value.body["param"] == "reasoning"
