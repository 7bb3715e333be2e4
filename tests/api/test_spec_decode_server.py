"""Speculative decoding through the real HTTP server: vLLM's vllm:spec_decode_* counters on
/metrics, and greedy answers (chat and completions, streamed or not, with a stop string cut
inside an accepted run) identical to a server without speculation, via the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL_NAME, TINY_FLAGS, start_server

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3})
REPETITIVE = list(range(5, 25)) * 4


def metric(base_url: str, name: str) -> dict[str, float]:
    """The samples of ``name`` by their position label ('' where unlabelled)."""
    text = httpx.get(base_url + "/metrics").text
    return {s.labels.get("position", ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


@pytest.fixture(scope="module")
def servers(tiny_model):
    plain = start_server(tiny_model[0], *TINY_FLAGS)
    try:
        spec = start_server(tiny_model[0], *TINY_FLAGS, "--speculative-config", SPEC)
    except Exception:
        plain.stop()
        raise
    yield plain, spec
    spec.stop()
    plain.stop()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def completion(server, stream: bool, **fields) -> str:
    kwargs = {"model": MODEL_NAME, "prompt": REPETITIVE, "max_tokens": 40,
              "temperature": 0.0, **fields}
    if not stream:
        return client(server).completions.create(**kwargs).choices[0].text
    chunks = client(server).completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def chat(server, stream: bool, **fields) -> str:
    kwargs = {"model": MODEL_NAME, "max_tokens": 40, "temperature": 0.0,
              "messages": [{"role": "user", "content": "ab cd ef " * 12}], **fields}
    if not stream:
        return client(server).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(server).chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.slow
def test_counters_grow_on_a_repetitive_prompt(servers) -> None:
    plain, spec = servers
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total")
    before = [metric(spec.base_url, n).get("", 0.0) for n in names]
    completion(spec, False, extra_body={"ignore_eos": True})
    drafts, drafted, accepted = (metric(spec.base_url, n).get("", 0.0) - b
                                 for n, b in zip(names, before))
    assert drafts > 0 and drafted >= drafts and accepted > 0
    per_pos = metric(spec.base_url, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert sorted(per_pos) == ["0", "1", "2"] and per_pos["0"] >= per_pos["2"]
    assert sum(per_pos.values()) == metric(
        spec.base_url, "vllm:spec_decode_num_accepted_tokens_total")[""]
    # the plain server has no drafts to count
    assert metric(plain.base_url, names[0]).get("", 0.0) == 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", [completion, chat], ids=["completions", "chat"])
def test_greedy_answers_equal_a_plain_server(servers, api, stream: bool) -> None:
    plain, spec = servers
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    before = metric(spec.base_url, accepted)[""]
    want = api(plain, stream, extra_body={"ignore_eos": True})
    got = api(spec, stream, extra_body={"ignore_eos": True})
    assert got == want
    assert metric(spec.base_url, accepted)[""] > before  # drafts were accepted on the way


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_string_inside_an_accepted_run(servers, stream: bool) -> None:
    """A stop string that starts strictly inside a multi-token delta of the speculative
    stream (an accepted run): both servers cut the text where it first occurs, without it."""
    plain, spec = servers
    want = completion(plain, stream, extra_body={"ignore_eos": True})
    stop = stop_inside_a_run(spec_chunks(spec))
    cut_want = completion(plain, stream, stop=[stop], extra_body={"ignore_eos": True})
    cut_got = completion(spec, stream, stop=[stop], extra_body={"ignore_eos": True})
    assert cut_got == cut_want == want[:want.index(stop)]
    # chat: the same stop handling (the tiny model's chat answer is one repeated token)
    piece = chat(plain, stream, extra_body={"ignore_eos": True})[5:7]
    assert (chat(spec, stream, stop=[piece], extra_body={"ignore_eos": True})
            == chat(plain, stream, stop=[piece], extra_body={"ignore_eos": True}))


def spec_chunks(server) -> list[str]:
    """The text deltas of a streamed greedy completion (one per engine step)."""
    stream = client(server).completions.create(
        model=MODEL_NAME, prompt=REPETITIVE, max_tokens=40, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    return [c.choices[0].text for c in stream if c.choices and c.choices[0].text]


def stop_inside_a_run(chunks: list[str]) -> str:
    """A 3-character piece of the text first occurring strictly inside a delta longer than
    one character (the text of accepted drafts plus the bonus token), past the first delta."""
    text = "".join(chunks)
    at = len(chunks[0])
    for chunk in chunks[1:]:
        for p in range(at + 1, at + len(chunk)):
            piece = text[p:p + 3]
            if len(piece) == 3 and text.find(piece) == p:
                return piece
        at += len(chunk)
    pytest.fail(f"no multi-token delta in {chunks!r}")
