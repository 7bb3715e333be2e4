"""Start-up order, API keys and graceful shutdown of the real server process."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it


def can_connect(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_port_closed_until_engine_ready(tiny_model, start_server_fn, tiny_flags) -> None:
    srv = start_server_fn(tiny_model[0], *tiny_flags, wait=False)
    try:
        deadline = time.monotonic() + 120
        while not can_connect(srv.port):
            assert srv.proc.poll() is None, srv.log()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # The first moment anything listens, the engine is loaded and healthy.
        log = srv.log()
        assert "Loaded " in log
        assert "KV cache:" in log
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        assert srv.stop() == 0


def test_api_key_protects_v1_only(tiny_model, start_server_fn, tiny_flags) -> None:
    srv = start_server_fn(tiny_model[0], *tiny_flags, env={"VLLM_API_KEY": "sekret"})
    try:
        url = srv.base_url + "/v1/models"
        missing = httpx.get(url)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekret"}).status_code == 200
        for open_path in ("/health", "/metrics", "/version"):
            assert httpx.get(srv.base_url + open_path).status_code == 200
    finally:
        srv.stop()


def test_sigterm_finishes_in_flight_requests_and_exits_0(tiny_model, start_server_fn,
                                                         tiny_flags) -> None:
    srv = start_server_fn(tiny_model[0], *tiny_flags)
    result: dict = {}
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "the quick", "stream": True, "max_tokens": 450, "ignore_eos": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body,
                          timeout=120) as resp:
            chunks = []
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    result["last_chunk_at"] = time.monotonic()
                    started.set()
                result["done"] = line == "data: [DONE]" or result.get("done", False)
            result["chunks"] = chunks

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    signalled_at = time.monotonic()
    code = srv.stop()  # SIGTERM while the stream is mid-way
    thread.join(60)
    assert code == 0
    assert result["done"]
    reasons = [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]]
    assert reasons[-1] == "length"
    assert result["last_chunk_at"] > signalled_at  # tokens kept coming after the signal
    assert not can_connect(srv.port)
