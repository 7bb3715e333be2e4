"""Queue bound (503), CORS, the console script, and the embedded default model over HTTP."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest


def test_waiting_queue_bound_gives_503(tiny_model, start_server_fn) -> None:
    srv = start_server_fn(tiny_model[0], "--dtype", "float32", "--block-size", "16",
                          "--max-num-seqs", "1", "--max-waiting-requests", "1")
    long_body = {"prompt": "the quick", "max_tokens": 400, "ignore_eos": True}
    try:
        threads = [threading.Thread(target=lambda: httpx.post(
            srv.base_url + "/v1/completions", json=long_body, timeout=120)) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(srv.base_url + "/metrics").text
            line = next(l for l in text.splitlines() if l.startswith("vllm:num_requests_waiting{"))
            if float(line.split()[-1]) >= 1:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        resp = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 503 and "overloaded" in resp.json()["error"]["message"]
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        srv.stop()


def test_cors_preflight(server) -> None:
    resp = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST"})
    assert resp.status_code == 200
    assert resp.headers["access-control-allow-origin"] in ("*", "http://example.test")


def test_console_script_lists_flags() -> None:
    script = Path(sys.executable).with_name("hpu-serve")
    out = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--max-num-seqs", "--max-model-len", "--block-size", "--gpu-memory-utilization",
                 "--enforce-eager", "--served-model-name", "--api-key", "--shutdown-timeout"):
        assert flag in out.stdout


@pytest.mark.slow
def test_default_model_serves_chat(start_server_fn) -> None:
    srv = start_server_fn(None, "--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        assert srv.stop() == 0
