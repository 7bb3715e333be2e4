"""Request logs (--enable-log-requests), request ids in logs and errors, and a real server's
--log-format json run: every line of it, warmup to shutdown, parses as JSON.

The fast tests drive the app over the scripted engine; the slow ones run
``python -m server serve`` with the tiny model under concurrent load, then SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Iterator

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_process import MODEL_NAME, TINY_FLAGS, start_server

from server.api.app import build_app
from server.config import LoggingConfig, ServerConfig
from server.log import FIELDS, request_context

SECRET = "zebra-quartz"  # prompt text that must never reach a log by default


class Lines(logging.Handler):
    """The request log's records, as (message, fields)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def fields(self) -> list[dict]:
        return [getattr(r, FIELDS) for r in self.records]


@pytest.fixture()
def request_lines() -> Iterator[Lines]:
    lines = Lines()
    logger = logging.getLogger("server.api.request_log")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(lines)


def app_client(**logging_cfg: object) -> TestClient:
    cfg = ServerConfig(logging=LoggingConfig(**logging_cfg))
    return TestClient(build_app(FakeEngine(), cfg))


def test_a_request_line_has_sizes_params_and_outcome_but_no_text(request_lines) -> None:
    with app_client(enable_log_requests=True) as client:
        resp = client.post("/v1/completions", headers={"X-Request-Id": "r-1"}, json={
            "model": "fake-model", "prompt": SECRET, "max_tokens": 3, "n": 2,
            "temperature": 0.5, "stop": ["never-" + SECRET]})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "r-1"
        client.get("/health")  # not a request that is logged
    [line] = request_lines.fields()
    assert line["request_id"] == "r-1" and line["status"] == 200
    assert line["prompt_tokens"] == len(SECRET) and line["completion_tokens"] == 6
    assert line["n"] == 2 and line["finish_reasons"] == ["length", "length"]
    assert line["params"]["temperature"] == 0.5 and line["params"]["max_tokens"] == 3
    assert line["params"]["stop"] == 1  # counted: a stop string is the client's text
    assert line["latency_s"] >= 0
    assert SECRET not in json.dumps(line, default=str)


def test_log_prompts_adds_the_texts_cut_at_max_log_len(request_lines) -> None:
    with app_client(enable_log_requests=True, log_prompts=True, max_log_len=5) as client:
        client.post("/v1/completions", json={"model": "fake-model", "prompt": SECRET,
                                             "max_tokens": 8, "stream": True})
    [line] = request_lines.fields()
    assert line["prompt"] == [SECRET[:5]] and line["output"] == ["abcde"]


def test_without_the_flag_nothing_is_logged(request_lines) -> None:
    with app_client() as client:
        client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
    assert request_lines.records == []


def test_a_refused_request_is_logged_and_its_error_names_the_request(request_lines) -> None:
    with app_client(enable_log_requests=True) as client:
        resp = client.post("/v1/completions", headers={"X-Request-Id": "bad-1"},
                           json={"model": "fake-model", "prompt": "x", "max_tokens": -1})
    assert resp.status_code == 400
    assert resp.json()["error"]["request_id"] == "bad-1"
    [line] = request_lines.fields()
    assert line["status"] == 400 and line["error_code"] == "invalid_value"
    assert "prompt_tokens" not in line  # it never reached the engine


def test_an_error_outside_a_request_names_none() -> None:
    from server.api.errors import error_body

    assert error_body(400, "x")["error"]["request_id"] is None
    with request_context("r-9"):
        assert error_body(400, "x")["error"]["request_id"] == "r-9"


# --- a real server, --log-format json, under load ---------------------------------------

def parse_all(log: str) -> list[dict]:
    """Every line as JSON (a line that is not fails the test, naming it)."""
    parsed = []
    for number, line in enumerate(log.splitlines(), 1):
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pytest.fail(f"line {number} is not JSON: {line!r}")
    return parsed


def load(base_url: str) -> dict[str, int]:
    """Concurrent requests: plain, chat, streamed, and a bad one; {request id: status}."""
    def one(i: int) -> tuple[str, int]:
        rid = f"load-{i}"
        body: dict = {"model": MODEL_NAME, "max_tokens": 24, "ignore_eos": True}
        if i % 4 == 3:
            body["max_tokens"] = -1  # refused: 400
        if i % 2:
            path, body["messages"] = "/v1/chat/completions", [
                {"role": "user", "content": f"{SECRET} {i}"}]
        else:
            path, body["prompt"] = "/v1/completions", f"{SECRET} {i}"
        body["stream"] = i % 4 == 2
        with httpx.Client(base_url=base_url, timeout=60) as client:
            resp = client.post(path, json=body, headers={"X-Request-Id": rid})
            assert resp.headers["x-request-id"] == rid
            if resp.status_code == 400:
                assert resp.json()["error"]["request_id"] == rid
            return rid, resp.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        return dict(pool.map(one, range(12)))


@pytest.mark.slow
def test_a_json_server_run_parses_line_by_line(tiny_model) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--log-format", "json",
                       "--enable-log-requests", env={"VLLM_LOG_STATS_INTERVAL": "0.5"},
                       fault="slow:0.03")  # the load outlasts a stats interval on any CPU
    try:
        statuses = load(srv.base_url)
    finally:
        assert srv.stop() == 0
    assert sorted(set(statuses.values())) == [200, 400]
    lines = parse_all(srv.log())
    assert all({"timestamp", "level", "logger", "message"} <= line.keys() for line in lines)
    loggers = {line["logger"] for line in lines}
    assert {"server.cli", "uvicorn.error", "uvicorn.access", "server.api.request_log"} <= loggers
    assert lines[-1]["logger"] == "uvicorn.error"  # through shutdown ("Finished server process")
    finished = {line["request_id"]: line for line in lines
                if line["logger"] == "server.api.request_log"}
    assert {rid: line["status"] for rid, line in finished.items()} == statuses
    accessed = {line["request_id"] for line in lines if line["logger"] == "uvicorn.access"}
    assert set(statuses) <= accessed
    assert all(line["completion_tokens"] == 24 for line in finished.values()
               if line["status"] == 200)
    assert SECRET not in srv.log()
    stats = [line for line in lines if line["logger"] == "server.engine.stats_log"]
    assert stats, "no stats line under load"
    assert {"prompt_throughput", "generation_throughput", "running", "waiting",
            "kv_cache_usage", "prefix_cache_hit_rate", "compilations",
            "bucket_misses"} <= stats[0].keys()
    assert any(line["generation_throughput"] > 0 for line in stats)


@pytest.mark.slow
def test_log_prompts_puts_the_prompt_text_in_the_request_line(tiny_model) -> None:
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--log-format", "json",
                       "--enable-log-requests", "--log-prompts")
    try:
        httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": SECRET, "max_tokens": 4})
    finally:
        srv.stop()
    [line] = [d for d in parse_all(srv.log()) if d["logger"] == "server.api.request_log"]
    assert line["prompt"] == [SECRET] and len(line["output"]) == 1
