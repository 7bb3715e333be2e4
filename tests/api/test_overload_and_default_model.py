"""Queue bound (503), CORS, the console script, and the embedded default model over HTTP."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest


def test_waiting_queue_bound_gives_503(tiny_model, start_server_fn) -> None:
    srv = start_server_fn(tiny_model[0], "--dtype", "float32", "--block-size", "16",
                          "--max-num-seqs", "1", "--max-waiting-requests", "1")
    long_body = {"prompt": "the quick", "max_tokens": 400, "ignore_eos": True}
    barrier = threading.Barrier(6)
    responses: list[httpx.Response] = []

    def post() -> None:
        barrier.wait()  # all six arrive together: one runs, one waits, the rest are refused
        responses.append(httpx.post(srv.base_url + "/v1/completions", json=long_body,
                                    timeout=120))

    try:
        threads = [threading.Thread(target=post) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(refused) + len(served) == 6 and refused and len(served) >= 2
        assert all("overloaded" in r.json()["error"]["message"] for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 400 for r in served)
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
