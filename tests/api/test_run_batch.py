"""``hpu-serve run-batch`` (vLLM's ``vllm run-batch``): an OpenAI batch file answered offline
by the server's own routes. Each answer line equals what the HTTP server answers for the
same body (greedy, the tiny random Llama); refusals carry the server's status and error;
a malformed file fails the run before any model loads; --enable-metrics serves /metrics
while the batch runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, free_port, start_server

pytestmark = pytest.mark.slow  # a batch process and a server of their own

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
COMPLETION = {"model": MODEL_NAME, "prompt": "the quick", "max_tokens": 6, "temperature": 0,
              "ignore_eos": True}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
    {"custom_id": "completion", "method": "POST", "url": "/v1/completions", "body": COMPLETION},
    {"custom_id": "no-such-model", "method": "POST", "url": "/v1/chat/completions",
     "body": dict(CHAT, model="NonExistModel")},
    {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
     "body": dict(COMPLETION, max_tokens=100_000)},
    {"custom_id": "bad-url", "method": "POST", "url": "/bad_url", "body": CHAT},
    {"custom_id": "stream", "method": "POST", "url": "/v1/chat/completions",
     "body": dict(CHAT, stream="True")},
]
# what differs between two answers to the same request
VOLATILE = ("id", "created", "request_id")


def run_batch(tmp_path: Path, model: str, lines: list[dict] | str, *flags: str
              ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(lines if isinstance(lines, str)
                      else "\n".join(json.dumps(line) for line in lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "server", "run-batch", "-i", str(source),
                           "-o", str(target), "--model", model, *flags],
                          capture_output=True, text=True, timeout=300)
    answers = ([json.loads(line) for line in target.read_text().splitlines()]
               if target.exists() else [])
    return done, answers


def stable(value: object) -> object:
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [stable(v) for v in value]
    if isinstance(value, float):  # a logprob: batched with other lines or not, fp32 noise
        return round(value, 4)
    return value


def test_answers_are_the_servers(tiny_model, tmp_path) -> None:
    port = free_port()
    scraped: list[int] = []

    def scrape() -> None:  # --enable-metrics: /metrics answers while the batch runs
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not scraped:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                if "vllm:num_requests_running" in response.text:
                    scraped.append(response.status_code)
            except httpx.TransportError:
                time.sleep(0.2)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    done, answers = run_batch(tmp_path, tiny_model[0], LINES, *TINY_FLAGS, "--enable-metrics",
                              "--host", "127.0.0.1", "--port", str(port))
    scraped.append(0)  # stops the scraper if it found nothing
    scraper.join()
    assert done.returncode == 0, done.stderr[-2000:]
    assert scraped[0] == 200
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in LINES]
    assert all(a["id"].startswith("vllm-") and a["response"]["request_id"] for a in answers)
    srv = start_server(tiny_model[0], *TINY_FLAGS)
    try:
        for line, answer in zip(LINES[:4], answers):
            served = httpx.post(srv.base_url + line["url"], json=line["body"], timeout=60)
            status = answer["response"]["status_code"]
            assert status == served.status_code, line["custom_id"]
            if status == 200:
                assert answer["error"] is None
                assert stable(answer["response"]["body"]) == stable(served.json())
            else:
                assert answer["response"]["body"] is None
                assert stable(answer["error"]) == stable(served.json())
    finally:
        srv.stop()
    assert answers[2]["response"]["status_code"] == 404
    assert answers[3]["response"]["status_code"] == 400
    assert answers[4]["response"]["status_code"] == 400 and "/bad_url" in answers[4]["error"]
    assert answers[5]["error"] == "Only non-streaming mode is supported."


def test_a_malformed_file_fails_before_the_model_loads(tmp_path) -> None:
    bad = json.dumps({"invalid_field": "request-1", "method": "POST",
                      "url": "/v1/chat/completions", "body": CHAT})
    done, answers = run_batch(tmp_path, str(tmp_path / "no-model-here"), bad)
    assert done.returncode != 0 and not answers
    assert "line 1 of the batch file" in done.stderr and "custom_id" in done.stderr


def test_an_empty_file_gives_an_empty_output(tiny_model, tmp_path) -> None:
    done, answers = run_batch(tmp_path, tiny_model[0], "", *TINY_FLAGS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out.jsonl").read_text() == "" and answers == []


def test_embeddings_lines_match_the_embedding_server(tiny_model, tmp_path) -> None:
    flags = (*TINY_FLAGS, "--convert", "embed")
    body = {"model": MODEL_NAME, "input": ["the quick brown fox", "jumps"]}
    done, answers = run_batch(tmp_path, tiny_model[0], [
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": body}], *flags)
    assert done.returncode == 0, done.stderr[-2000:]
    srv = start_server(tiny_model[0], *flags)
    try:
        served = httpx.post(srv.base_url + "/v1/embeddings", json=body, timeout=60).json()
    finally:
        srv.stop()
    got = answers[0]["response"]["body"]
    assert len(got["data"]) == 2
    for mine, theirs in zip(got["data"], served["data"]):
        assert mine["embedding"] == pytest.approx(theirs["embedding"], abs=1e-6)
