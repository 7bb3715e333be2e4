"""Prefix caching seen from outside: vLLM's counters on /metrics and POST
/reset_prefix_cache behind the API key."""

from __future__ import annotations

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-prefix-caching",
                       env={"VLLM_API_KEY": "k3y"})
    yield srv
    srv.stop()


def test_shared_prefix_hits_are_counted_and_reset_forgets_them(keyed_server) -> None:
    url, auth = keyed_server.base_url, {"Authorization": "Bearer k3y"}
    prefix = list(range(10, 60))  # 3 full blocks of 16
    for tail in ([1, 2], [3, 4, 5]):
        resp = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
            "model": MODEL_NAME, "prompt": prefix + tail, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
    assert keyed_server.metric("vllm:prefix_cache_queries_total") == 52 + 53
    assert keyed_server.metric("vllm:prefix_cache_hits_total") == 48
    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    reset = httpx.post(url + "/reset_prefix_cache", headers=auth)
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 3
    httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
        "model": MODEL_NAME, "prompt": prefix + [6], "max_tokens": 3})
    assert keyed_server.metric("vllm:prefix_cache_hits_total") == 48  # nothing left to hit


def test_observed_shapes_behind_the_key(keyed_server) -> None:
    """GET /buckets/observed: the unpadded step shapes the engine ran, behind --api-key."""
    url, auth = keyed_server.base_url, {"Authorization": "Bearer k3y"}
    assert httpx.get(url + "/buckets/observed").status_code == 401
    before = httpx.get(url + "/buckets/observed", headers=auth).json()
    resp = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
        "model": MODEL_NAME, "prompt": list(range(100, 137)), "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    after = httpx.get(url + "/buckets/observed", headers=auth).json()
    assert after["format"] == "hpu-serve/observed-shapes/v1" and after["block_size"] == 16
    prompt, decode = after["phases"]["prefill"], after["phases"]["decode"]
    assert prompt["steps"] == before["phases"]["prefill"]["steps"] + 1
    assert [1, 37, 0] in [s[:3] for s in prompt["shapes"]]  # (bs, query, ctx blocks)
    # 3 decode steps of one sequence, 3 KV blocks (37..40 tokens)
    assert decode["steps"] == before["phases"]["decode"]["steps"] + 3
    assert [1, 1, 3] in [s[:3] for s in decode["shapes"]]
    assert keyed_server.metric("hpu_serve:step_shape_count") >= 4 * 2


def test_suggest_reads_a_live_server_with_its_key(keyed_server, tmp_path, capsys) -> None:
    from server.cli import main
    from server.hpu.buckets.plan import parse_bucket_file

    resp = httpx.post(keyed_server.base_url + "/v1/completions", timeout=60,
                      headers={"Authorization": "Bearer k3y"},
                      json={"model": MODEL_NAME, "prompt": list(range(200, 230)), "max_tokens": 3})
    assert resp.status_code == 200, resp.text  # traffic of its own, whatever ran before
    out = tmp_path / "buckets.txt"
    assert main(["buckets", "--suggest", "--from", keyed_server.base_url, "--api-key", "k3y",
                 "--max-buckets", "40", "-o", str(out)]) == 0
    assert "suggested" in capsys.readouterr().out and parse_bucket_file(str(out))


@pytest.fixture(scope="module")
def detailed_server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-prefix-caching",
                       "--enable-prompt-tokens-details")
    yield srv
    srv.stop()


def cached(base_url: str, prompt: list[int], **fields: object) -> int:
    resp = httpx.post(base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_and_cache_salt(detailed_server) -> None:
    """usage.prompt_tokens_details.cached_tokens counts the prompt tokens the cache served;
    cache_salt keeps tenants apart: a prompt cached under one salt is a miss under another
    (and without one), and a hit under the same salt (vLLM's semantics)."""
    url = detailed_server.base_url
    prompt = list(range(100, 150))  # 3 full blocks of 16, then 2 tokens
    assert cached(url, prompt) == 0
    assert cached(url, prompt) == 48
    assert cached(url, prompt, cache_salt="tenant-a") == 0  # the unsalted blocks: not a's
    assert cached(url, prompt, cache_salt="tenant-b") == 0
    assert cached(url, prompt, cache_salt="tenant-a") == 48  # a's own blocks
    assert cached(url, prompt) == 48  # and the unsalted ones are still there
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello " * 40}],
        "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    last = [line for line in chat.text.splitlines() if line.startswith("data: {")][-1]
    assert '"prompt_tokens_details": {"cached_tokens": 0}' in last


def test_usage_has_no_details_without_the_flag(keyed_server) -> None:
    resp = httpx.post(keyed_server.base_url + "/v1/completions", timeout=60,
                      headers={"Authorization": "Bearer k3y"},
                      json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2})
    assert "prompt_tokens_details" not in resp.json()["usage"] or \
        resp.json()["usage"]["prompt_tokens_details"] is None
