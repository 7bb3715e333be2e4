"""A real `python -m server serve` process on a free loopback port, shared by every test file
of the session that takes `server` (the tiny model, TINY_FLAGS): a server start is ~4 s of the
edit loop. A test that changes what later files would see (stops the server, puts it to
sleep, needs other flags or a fresh prefix cache or fresh counters) starts its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server


@pytest.fixture(scope="session")
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


HERMES_TEMPLATE = Path(__file__).resolve().parents[2] / "config/chat_templates/chatml_hermes_tools.jinja"


@pytest.fixture(scope="session")
def smollm2_server():
    """The embedded SmolLM2 as an agent backend: its ChatML with tools (the same prompt as
    its own template when a request has no tools), hermes tool calls."""
    srv = start_server(None, "--max-num-seqs", "32", "--max-model-len", "1024",
                       "--chat-template", str(HERMES_TEMPLATE), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes")
    yield srv
    srv.stop()
