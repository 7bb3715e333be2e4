"""A real `python -m server serve` process on a free loopback port, shared per module."""

from __future__ import annotations

import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name() -> str:
    return MODEL_NAME
