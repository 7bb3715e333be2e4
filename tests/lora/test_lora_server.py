"""Adapters through the real HTTP server and the OpenAI and Anthropic SDKs: selection by
``model``, answers naming the adapter, /v1/models, runtime load / unload
(VLLM_ALLOW_RUNTIME_LORA_UPDATING), prefix-cache isolation between adapters, bad adapters as
400s that name the problem (the engine serving on), and vLLM's lora_requests_info gauge."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL_NAME, TINY_FLAGS, start_server

from tests.lora.conftest import hf_greedy, merged

pytestmark = pytest.mark.slow
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model, adapter_factory) -> dict[str, str]:
    hf_model = tiny_model[1]
    return {"a": adapter_factory(hf_model, 8, seed=11), "b": adapter_factory(hf_model, 16,
                                                                          seed=12)}


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "16", "--lora-modules", f"a={adapters['a']}",
                       f"c={adapters['b']}", "--enable-prompt-tokens-details", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield srv
    srv.stop()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 11, 23)]


async def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x") as client:
        out = await client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0)
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_models_list_adapters_with_their_parent(lora_server, adapters) -> None:
    data = httpx.get(lora_server.base_url + "/v1/models").json()["data"]
    cards = {card["id"]: card for card in data}
    assert cards["a"]["parent"] == MODEL_NAME and cards["a"]["root"] == adapters["a"]
    assert cards[MODEL_NAME].get("parent") is None
    assert httpx.get(lora_server.base_url + "/v1/models/a").json()["parent"] == MODEL_NAME


def test_runtime_adapter_serves_alongside_and_unloads(lora_server, tiny_model,
                                                      adapters) -> None:
    url, hf_model = lora_server.base_url, tiny_model[1]
    load = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": "b", "lora_path": adapters["b"]})
    assert load.status_code == 200, load.text
    assert load.text == "Success: LoRA adapter 'b' added successfully."
    prompts = _prompts(hf_model.config.vocab_size)
    models = [MODEL_NAME, "a", "b"]

    async def all_at_once() -> list[list[int]]:  # base, a and b share steps
        return await asyncio.gather(*(_complete(url, m, p) for m in models for p in prompts))

    got = asyncio.run(all_at_once())
    refs = {MODEL_NAME: hf_model, "a": merged(hf_model, adapters["a"]),
            "b": merged(hf_model, adapters["b"])}
    want = [hf_greedy(refs[m], p, NEW_TOKENS) for m in models for p in prompts]
    assert got == want
    assert want[:3] != want[3:6] and want[:3] != want[6:]  # the adapters change answers
    info = [s for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in f.samples if s.name == "vllm:lora_requests_info"]
    assert info and info[0].labels["max_lora"] == "2"

    unload = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert unload.status_code == 200, unload.text
    with pytest.raises(openai.NotFoundError):
        asyncio.run(_complete(url, "b", prompts[0]))
    again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "The lora adapter 'b' cannot be found."
    assert "b" not in {c["id"] for c in httpx.get(url + "/v1/models").json()["data"]}


def test_answers_name_the_adapter(lora_server) -> None:
    """vLLM names the adapter in an answer's model field: completions, chat (whole and
    streamed), the Responses API and Anthropic's Messages API; the base keeps its name."""
    url = lora_server.base_url
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "hi"}]
    for model in ("a", MODEL_NAME):
        done = client.completions.create(model=model, prompt=[5, 6], max_tokens=2)
        assert done.model == model
        chunks = list(client.completions.create(model=model, prompt=[5, 6], max_tokens=2,
                                                stream=True))
        assert chunks and {c.model for c in chunks} == {model}
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert chat.model == model
        chunks = list(client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=2, stream=True))
        assert chunks and {c.model for c in chunks} == {model}
        assert client.responses.create(model=model, input="hi",
                                       max_output_tokens=2).model == model
        claude = anthropic.Anthropic(base_url=url, api_key="x")
        assert claude.messages.create(model=model, messages=messages,
                                      max_tokens=2).model == model
        with claude.messages.stream(model=model, messages=messages, max_tokens=2) as events:
            assert events.get_final_message().model == model


def test_prefix_cache_is_not_shared_between_adapters(lora_server, tiny_model,
                                                     adapters) -> None:
    """The same long prompt for adapter a, then adapter c (b's weights), then a again:
    c's first request computes every token (0 cached), a's second reuses a's blocks, and
    every answer is its merged reference's."""
    url, hf_model = lora_server.base_url, tiny_model[1]
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, hf_model.config.vocab_size, (70,), generator=gen).tolist()
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")

    def complete(model: str) -> tuple[list[int], int]:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        details = out.usage.prompt_tokens_details
        assert details is not None  # --enable-prompt-tokens-details
        return ([int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens],
                details.cached_tokens or 0)

    first_a, _ = complete("a")
    first_c, cached_c = complete("c")
    second_a, cached_a = complete("a")
    assert cached_c == 0
    assert cached_a >= 64  # four whole 16-token blocks of a's own
    want_a = hf_greedy(merged(hf_model, adapters["a"]), prompt, NEW_TOKENS)
    want_c = hf_greedy(merged(hf_model, adapters["b"]), prompt, NEW_TOKENS)
    assert want_a != want_c
    assert first_a == second_a == want_a
    assert first_c == want_c


def _copy(src: str, dst: Path, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit is not None:
        config = json.loads((dst / "adapter_config.json").read_text())
        edit(config)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    return str(dst)


def test_bad_adapters_are_400s_naming_the_problem(lora_server, adapters, tmp_path,
                                                  tiny_model_factory, adapter_factory) -> None:
    url = lora_server.base_url
    other = tiny_model_factory(model_type="qwen3", num_kv_heads=2)[1]  # other shapes
    cases = {
        "missing": (str(tmp_path / "nowhere"), "no adapter_config.json"),
        "rank": (adapter_factory(other, 32, seed=3), "rank 32 is greater than max_lora_rank 16"),
        "shapes": (adapter_factory(other, 8, seed=4), "wrong base model"),
        "targets": (_copy(adapters["a"], tmp_path / "t",
                          lambda c: c.update(target_modules=["q_proj", "lm_head"])),
                    "unknown target modules ['lm_head']"),
        "dora": (_copy(adapters["a"], tmp_path / "d", lambda c: c.update(use_dora=True)),
                 "use_dora=True is not supported"),
    }
    for name, (path, words) in cases.items():
        resp = httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": name, "lora_path": path})
        assert resp.status_code == 400, (name, resp.text)
        assert words in resp.json()["error"]["message"], (name, resp.text)
    dup = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a",
                                                          "lora_path": adapters["a"]})
    assert dup.status_code == 400
    assert dup.json()["error"]["message"] == "The lora adapter 'a' has already been loaded."
    # still serving, adapters and base alike
    resp = httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "a", "prompt": [5, 6, 7], "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_without_the_knob_the_endpoints_do_not_exist(tiny_model, adapters) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-lora")
    try:
        resp = httpx.post(srv.base_url + "/v1/load_lora_adapter",
                          json={"lora_name": "b", "lora_path": adapters["b"]})
        assert resp.status_code == 404
    finally:
        srv.stop()


def test_a_bad_lora_module_stops_start_up(tiny_model, tmp_path) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-lora", "--lora-modules",
                       f"x={tmp_path}", wait=False)
    try:
        assert srv.proc.wait(timeout=120) != 0
        assert "no adapter_config.json" in srv.log()
    finally:
        srv.stop()
