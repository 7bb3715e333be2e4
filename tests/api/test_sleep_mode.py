"""Sleep mode through a real server: admin routes behind the key and absent without the
flag, streams in flight aborted at /sleep, 503 + Retry-After while asleep, the same greedy
outputs after /wake_up, /reload_weights to another model, and RSS freed at each level."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

pytestmark = pytest.mark.slow  # servers of their own, slept and woken

KEY = "sleep-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the quick brown fox"


def complete(base: str, prompt: str = PROMPT, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def stream_until_done(base: str, finish: list[str]) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", headers=AUTH, json=body,
                      timeout=60) as response:
        for line in response.iter_lines():
            if '"finish_reason":"' in line.replace(" ", ""):
                finish.append(line.split('"finish_reason":')[1].split('"')[1])


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--enable-sleep-mode", "--api-key", KEY)
    yield srv
    srv.stop()


def test_admin_routes_need_the_key(server) -> None:
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/reload_weights")):
        assert httpx.request(method, server.base_url + path).status_code == 401


def test_sleep_with_streams_then_503_then_wake_same_outputs(server) -> None:
    base = server.base_url
    before = complete(base).json()["choices"][0]["text"]
    finish: list[str] = []
    streams = [threading.Thread(target=stream_until_done, args=(base, finish))
               for _ in range(3)]
    for t in streams:
        t.start()
    while httpx.get(f"{base}/metrics").text.find("num_requests_running") < 0:
        pass
    slept = httpx.post(f"{base}/sleep", params={"level": 1}, headers=AUTH, timeout=60)
    assert slept.status_code == 200 and slept.json()["is_sleeping"] is True
    for t in streams:
        t.join(timeout=30)
        assert not t.is_alive(), "a stream hung across /sleep"
    # each stream ended: aborted at /sleep, or refused before it was queued
    asleep = complete(base)
    assert asleep.status_code == 503 and asleep.headers["Retry-After"]
    assert asleep.json()["error"]["code"] == "engine_sleeping"
    assert httpx.get(f"{base}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert httpx.get(f"{base}/health").status_code == 200  # as vLLM: alive, asleep
    woke = httpx.post(f"{base}/wake_up", headers=AUTH, timeout=60)
    assert woke.json() == {"is_sleeping": False}
    assert complete(base).json()["choices"][0]["text"] == before


def sleep_state(base: str) -> dict[str, float]:
    """vllm:engine_sleep_state's value per sleep_state label, parsed as Prometheus does."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    return {s.labels["sleep_state"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "vllm:engine_sleep_state" for s in f.samples}


def test_sleep_state_gauge_follows_sleep_and_wake(server) -> None:
    base = server.base_url
    awake = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert sleep_state(base) == awake
    httpx.post(f"{base}/sleep", params={"level": 1}, headers=AUTH, timeout=60)
    assert sleep_state(base) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    # a wake of the weights alone leaves the engine asleep, and the gauge says so
    httpx.post(f"{base}/wake_up", params={"tags": "weights"}, headers=AUTH, timeout=60)
    assert sleep_state(base)["awake"] == 0.0
    httpx.post(f"{base}/wake_up", params={"tags": "kv_cache"}, headers=AUTH, timeout=60)
    assert sleep_state(base) == awake
    httpx.post(f"{base}/sleep", params={"level": 2}, headers=AUTH, timeout=60)
    assert sleep_state(base) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
    httpx.post(f"{base}/wake_up", headers=AUTH, timeout=120)
    assert sleep_state(base) == awake
    assert complete(base).status_code == 200


def test_bad_input_is_a_clear_400(server, tiny_model_factory) -> None:
    base = server.base_url
    bad = httpx.post(f"{base}/sleep", params={"level": 3}, headers=AUTH)
    assert bad.status_code == 400 and "level must be 1 or 2" in bad.text
    bad = httpx.post(f"{base}/wake_up", params={"tags": "gpu"}, headers=AUTH)
    assert bad.status_code == 400 and "unknown tag" in bad.text
    other = tiny_model_factory(num_kv_heads=4)
    bad = httpx.post(f"{base}/reload_weights", json={"path": other[0]}, headers=AUTH,
                     timeout=60)
    assert bad.status_code == 400 and "num_kv_heads" in bad.json()["error"]["message"]
    assert httpx.post(f"{base}/reload_weights", json={}, headers=AUTH).status_code == 400


def test_reload_weights_changes_the_outputs(server, tiny_model, tiny_model_factory) -> None:
    base = server.base_url
    before = complete(base).json()["choices"][0]["text"]
    second = tiny_model_factory(seed=1)
    done = httpx.post(f"{base}/reload_weights", json={"path": second[0]}, headers=AUTH,
                      timeout=120)
    assert done.status_code == 200, done.text
    assert complete(base).json()["choices"][0]["text"] != before
    httpx.post(f"{base}/reload_weights", json={"path": tiny_model[0]}, headers=AUTH,
               timeout=120)
    assert complete(base).json()["choices"][0]["text"] == before


def test_routes_absent_without_the_flag(tiny_model) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--api-key", KEY)
    try:
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/reload_weights")):
            assert httpx.request(method, srv.base_url + path, headers=AUTH).status_code == 404
    finally:
        srv.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_rss_drops_by_the_kv_cache_then_the_weights_too(tiny_model, tmp_path) -> None:
    """A wider model (~61 MiB of float32 weights) and a 128 MiB KV cache, so each drop
    stands out of the noise."""
    import torch
    import transformers

    tokenizer = tiny_model[2]
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    weights = sum(p.numel() * 4 for p in model.parameters())
    blocks = 2048
    kv = 2 * 4 * 16 * 2 * 64 * 4 * (blocks + 1)  # K and V, 4 layers, 16-token blocks
    srv = start_server(str(tmp_path), *TINY_FLAGS, "--enable-sleep-mode", "--api-key", KEY,
                       "--num-gpu-blocks-override", str(blocks))
    try:
        base, pid = srv.base_url, srv.proc.pid
        before = complete(base).json()["choices"][0]["text"]
        drops = {}
        for level in (0, 1, 2):  # 0: an unmeasured level 1 hands start-up's garbage back
            level = level or 1
            awake = rss_bytes(pid)
            assert httpx.post(f"{base}/sleep", params={"level": level}, headers=AUTH,
                              timeout=60).status_code == 200
            drops[level] = awake - rss_bytes(pid)  # the last level 1 counts
            httpx.post(f"{base}/wake_up", headers=AUTH, timeout=120)
            assert complete(base).json()["choices"][0]["text"] == before
        print(f"KV cache {kv / 2**20:.1f} MiB, weights {weights / 2**20:.1f} MiB; RSS drop "
              f"level 1 {drops[1] / 2**20:.1f} MiB, level 2 {drops[2] / 2**20:.1f} MiB")
        # the bar: level 1 frees the KV cache, level 2 the weights too (5-10% slack
        # for the heap's bookkeeping; a heap top left mapped cost 30 MiB of the KV cache)
        assert drops[1] >= 0.95 * kv
        assert drops[2] - drops[1] >= 0.9 * weights
    finally:
        srv.stop()
