"""Queue bound (503), CORS, the console script, and the embedded default model over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it


def _waiting(base_url: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_waiting missing from /metrics")


def test_waiting_queue_bound_gives_503(tiny_model, start_server_fn) -> None:
    """One request runs (the only slot), one waits (the bound), the next is refused."""
    srv = start_server_fn(tiny_model[0], "--dtype", "float32", "--block-size", "16",
                          "--max-num-seqs", "1", "--max-waiting-requests", "1")
    url = srv.base_url + "/v1/completions"
    body = {"prompt": "the quick", "max_tokens": 480, "ignore_eos": True}
    waiting: list[httpx.Response] = []
    try:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", url, json={**body, "stream": True,
                                  "stream_options": {"include_usage": True}}) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it runs
            second = threading.Thread(
                target=lambda: waiting.append(httpx.post(url, json=body, timeout=120)))
            second.start()
            while _waiting(srv.base_url) < 1:  # the second request is queued behind it
                time.sleep(0.005)
            refused = client.post(url, json=body)
            rest = [line for line in lines if line.startswith("data:")]
            second.join()
        assert refused.status_code == 503, refused.text
        assert "overloaded" in refused.json()["error"]["message"]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 480
        assert waiting[0].status_code == 200
        assert waiting[0].json()["usage"]["completion_tokens"] == 480
        assert _waiting(srv.base_url) == 0
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
