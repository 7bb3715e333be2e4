"""vLLM's tokenizer endpoints through the real server: GET /tokenizer_info (behind
--enable-tokenizer-info-endpoint) and /tokenize's chat fields (tools, continue_final_message,
return_token_strs), checked against transformers' own tokenizer of the same folder."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server
from transformers import AutoTokenizer

# its own server (with the endpoint and a template that renders tools)
pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

HERMES_TEMPLATE = (Path(__file__).resolve().parents[2]
                   / "config/chat_templates/chatml_hermes_tools.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def info_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-tokenizer-info-endpoint",
                       "--chat-template", str(HERMES_TEMPLATE))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers' tokenizer of the served folder, with the server's --chat-template."""
    hf = AutoTokenizer.from_pretrained(tiny_model[0])
    hf.chat_template = HERMES_TEMPLATE.read_text()
    return hf


def test_tokenizer_info_reports_the_tokenizer(info_server, reference) -> None:
    resp = httpx.get(info_server.base_url + "/tokenizer_info")
    assert resp.status_code == 200
    info = resp.json()
    assert info["tokenizer_class"] == type(reference).__name__
    assert info["chat_template"] == reference.chat_template  # --chat-template's
    for name in ("bos_token", "eos_token", "unk_token"):
        assert info[name] == getattr(reference, name)
    assert "name_or_path" not in info  # no path of the server's disk
    # consistent with /tokenize (vLLM's test: the info's length is at least the context)
    count = httpx.post(info_server.base_url + "/tokenize", json={"prompt": "hi"}).json()
    if info.get("model_max_length"):
        assert info["model_max_length"] >= count["max_model_len"]


def test_tokenizer_info_is_off_by_default(server) -> None:
    assert httpx.get(server.base_url + "/tokenizer_info").status_code == 404


@pytest.mark.parametrize(("generation", "continue_final"), [(True, False), (False, False),
                                                             (False, True)])
def test_tokenize_chat_with_tools_matches_transformers(info_server, reference, generation,
                                                       continue_final) -> None:
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    if continue_final:
        messages.append({"role": "assistant", "content": "Sure,"})
    text = reference.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=generation,
                                         continue_final_message=continue_final)
    want = reference.encode(text, add_special_tokens=False)
    resp = httpx.post(info_server.base_url + "/tokenize", json={
        "model": MODEL_NAME, "messages": messages, "tools": TOOLS,
        "add_generation_prompt": generation, "continue_final_message": continue_final})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == want
    assert body["count"] == len(want)
    assert body["token_strs"] is None
    assert "get_weather" in reference.decode(body["tokens"])  # the tools reached the template


def test_tokenize_returns_token_strs(info_server, reference) -> None:
    prompt = "This is a token_strs test prompt!"
    body = httpx.post(info_server.base_url + "/tokenize",
                      json={"prompt": prompt, "return_token_strs": True}).json()
    assert body["tokens"] == reference.encode(prompt)
    assert body["token_strs"] == reference.convert_ids_to_tokens(body["tokens"])


def test_tokenize_refuses_what_it_would_ignore(info_server) -> None:
    url = info_server.base_url + "/tokenize"
    messages = [{"role": "user", "content": "hi"}]
    resp = httpx.post(url, json={"messages": messages, "chat_template": "{{ 'x' }}"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "chat_template"
    both = httpx.post(url, json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400  # add_generation_prompt defaults to true
    assert both.json()["error"]["param"] == "continue_final_message"
    reserved = httpx.post(url, json={"messages": messages,
                                     "chat_template_kwargs": {"tools": []}})
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs"
