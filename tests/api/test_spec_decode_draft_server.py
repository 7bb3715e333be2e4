"""The draft_model method through the real HTTP server: vLLM's --speculative-config JSON
with a draft checkpoint, greedy chat and completions (streamed or not) identical to a
server without speculation via the openai SDK, and the vllm:spec_decode_* counters."""

from __future__ import annotations

import json

import openai
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server
from spec_draft import draft_pair


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    _, model, tokenizer = tiny_model
    target, draft = draft_pair(model, tokenizer, tmp_path_factory.mktemp("pair"))
    config = json.dumps({"method": "draft_model", "model": draft,
                         "num_speculative_tokens": 4})
    plain = start_server(target, *TINY_FLAGS)
    try:
        spec = start_server(target, *TINY_FLAGS, "--speculative-config", config)
    except Exception:
        plain.stop()
        raise
    yield plain, spec
    spec.stop()
    plain.stop()


def ask(server, api: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    common = {"model": MODEL_NAME, "max_tokens": 32, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}}
    if api == "completions":
        kwargs = {"prompt": "a quick brown fox jumps over", **common}
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        chunks = client.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    kwargs = {"messages": [{"role": "user", "content": "tell me about the sea"}], **common}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_greedy_answers_equal_a_plain_server(servers, api: str, stream: bool) -> None:
    plain, spec = servers
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    before = [spec.metric(n, default=0.0) for n in names]
    assert ask(spec, api, stream) == ask(plain, api, stream)
    drafts, drafted, accepted = (spec.metric(n) - b for n, b in zip(names, before))
    assert drafts > 0 and drafted >= drafts and accepted > 0
    assert plain.metric(names[0], default=0.0) == 0
