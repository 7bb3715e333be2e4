"""Concurrency, client disconnects and /metrics against the real server."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def scrape(server) -> dict[str, float]:
    """Sample name (with sorted labels) -> value."""
    text = httpx.get(server.base_url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def sse_text(lines: list[str]) -> tuple[str, list[str]]:
    import json

    text, reasons = "", []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            text += choice.get("text", "")
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return text, reasons


@pytest.mark.slow  # 32 streams against 32 whole answers (14 s): make test-fast skips it
def test_32_concurrent_streams_match_non_streamed(server) -> None:
    prompts = [f"numbers {i} {i + 1}" for i in range(32)]
    body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    expected = [httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"prompt": p, **body}).json()["choices"][0]["text"]
                for p in prompts]

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, list[str]]:
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": prompt, "stream": True, **body}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in resp.aiter_lines()]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        return sse_text(lines)

    async def main() -> list[tuple[str, list[str]]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [text for text, _ in results] == expected
    assert all(reasons == ["length"] for _, reasons in results)


def test_disconnect_mid_stream_frees_blocks(server) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json={
                "prompt": "the quick", "stream": True, "max_tokens": 400, "ignore_eos": True,
            }) as resp:
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # leave: closing the response drops the connection

    asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = scrape(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    m = scrape(server)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:request_success_total{finished_reason=abort}"] >= 1


def test_metrics_counters_match_usage(server) -> None:
    before = scrape(server)
    usages = []
    for i in range(3):
        resp = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": f"the quick brown {i}", "max_tokens": 3 + i, "ignore_eos": True})
        usages.append(resp.json()["usage"])
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:request_success_total{finished_reason=length}") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert delta("vllm:request_generation_tokens_sum") == 3 + 4 + 5
    assert delta("hpu_serve:real_tokens_total{phase=decode}") == sum(
        u["completion_tokens"] - 1 for u in usages)
    assert delta("hpu_serve:padded_tokens_total{phase=prefill}") >= sum(
        u["prompt_tokens"] for u in usages)
    assert after["hpu_serve:graph_compilations_total{phase=decode,stage=serving}"] == 0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:request_queue_time_seconds_count"):
        assert name in after


def test_disconnect_before_a_non_streamed_reply_aborts_it(server) -> None:
    import json as _json
    import socket

    body = _json.dumps({"prompt": "the quick", "max_tokens": 450, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    aborts = scrape(server).get("vllm:request_success_total{finished_reason=abort}", 0.0)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request + body)
        deadline = time.monotonic() + 20
        while scrape(server)["vllm:num_requests_running"] == 0:  # until it is generating
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while scrape(server)["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    m = scrape(server)
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:request_success_total{finished_reason=abort}"] == aborts + 1
