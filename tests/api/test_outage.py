"""Through HTTP: one request can never take the server down; a dead engine ends the process.

The first finding of the reliability review: a chat completion with ``"seed": 2**70`` killed
the engine loop, and every later request got 503 until a restart.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

POISON = 7
MSG = [{"role": "user", "content": "hi"}]


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 4, **fields}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def completion(server, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def kv_usage(server) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc series")


@pytest.fixture(scope="module")
def poisoned_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, fault=f"poison:{POISON}")
    yield srv
    srv.stop()


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**63])
def test_seed_out_of_range_is_400_and_the_server_goes_on(poisoned_server, seed: int) -> None:
    resp = chat(poisoned_server, seed=seed)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "seed"
    assert chat(poisoned_server, seed=2**63 - 1).status_code == 200
    assert httpx.get(poisoned_server.base_url + "/health").status_code == 200


def test_a_failing_request_gets_500_and_the_others_go_on(poisoned_server) -> None:
    prompts = [[3, 4, 5, 6], [3, POISON, 5], [8, 9, 10, 11]]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        good_a, bad, good_b = pool.map(lambda p: completion(poisoned_server, p), prompts)
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["type"] == "InternalServerError"
    assert "failed" in error["message"]
    assert bad.headers["x-request-id"] in error["message"]  # findable in the server log
    for resp in (good_a, good_b):
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(poisoned_server.base_url + "/health").status_code == 200
    assert kv_usage(poisoned_server) == 0.0
    assert "Traceback" in poisoned_server.log()
    assert "OverflowError" in poisoned_server.log()


def test_a_stream_that_fails_ends_with_an_error_event_and_done(poisoned_server) -> None:
    resp = completion(poisoned_server, [3, POISON, 5], stream=True)
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2]
    assert "failed" in events[-2]
    assert completion(poisoned_server, [3, 4, 5]).status_code == 200


def test_engine_fault_exits_the_process_non_zero(tiny_model) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, fault="device")
    try:
        statuses = []
        for _ in range(4):
            try:
                statuses.append(completion(srv, [3, 4, 5]).status_code)
            except httpx.HTTPError:
                statuses.append(None)  # the port already closed
        deadline = time.monotonic() + 60
        while srv.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.proc.poll() == 1, srv.log()
        assert statuses[:2] == [500, 500]
        assert statuses[2] in (503, 500)
        assert "the engine died" in srv.log()
    finally:
        srv.stop()
