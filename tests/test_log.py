"""Log lines: the JSON formatter, the unchanged text format, JSON for every logger of a process
(warnings, libraries, uncaught exceptions, uvicorn's), the request id, the stats line."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.cli import build_parser
from server.config import LogFormat, LoggingConfig, server_config_from_args
from server.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from server.engine.stats_log import StatsLog
from server.log import FIELDS, JsonFormatter, TextFormatter, request_context

ROOT = Path(__file__).resolve().parents[1]
TEXT_LINE = re.compile(r"^(INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d [\w.]+: .+")


def record(message: str = "hello %s", args: tuple = ("world",), name: str = "server.x",
           **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.INFO, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_a_json_line_has_the_fields_and_the_request_id() -> None:
    with request_context("req-7"):
        line = JsonFormatter().format(record(**{FIELDS: {"status": 200, "level": "spoof"}}))
    data = json.loads(line)
    assert data["message"] == "hello world" and data["logger"] == "server.x"
    assert data["level"] == "INFO" and data["request_id"] == "req-7"
    assert data["status"] == 200  # a structured field, top level
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", data["timestamp"])
    outside = json.loads(JsonFormatter().format(record()))
    assert "request_id" not in outside


def test_an_exception_stays_on_one_line_as_a_field() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        rec = record(exc_info=sys.exc_info())
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_uvicorn_access_lines_get_their_parts_as_fields() -> None:
    rec = record('%s - "%s %s HTTP/%s" %d', ("1.2.3.4:5", "POST", "/v1/completions", "1.1", 400),
                 name="uvicorn.access")
    data = json.loads(JsonFormatter().format(rec))
    assert data["status"] == 400 and data["path"] == "/v1/completions"


def test_text_lines_are_unchanged_and_fields_follow_the_message() -> None:
    with request_context("req-7"):
        line = TextFormatter().format(record())
    assert TEXT_LINE.match(line) and line.endswith("server.x: hello world")
    with_fields = TextFormatter().format(record(**{FIELDS: {"status": 200, "path": "/v1 x"}}))
    assert with_fields.endswith('hello world status=200 path="/v1 x"')


# Run in a fresh interpreter: init_logging sets the process's logging up for good.
JSON_PROCESS = """
import logging, threading, warnings
from server.config import LogFormat
from server.log import init_logging, uvicorn_log_config
import logging.config, uvicorn.config
init_logging(LogFormat.JSON)
logging.config.dictConfig(uvicorn_log_config(LogFormat.JSON, uvicorn.config.LOGGING_CONFIG))
logging.getLogger("server.engine").info("from the engine")
logging.getLogger("some.library").warning("from a library")
logging.getLogger("uvicorn.error").info("from uvicorn")
logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "c", "GET", "/", "1.1", 200)
warnings.warn("a warning")
t = threading.Thread(target=lambda: 1 / 0, name="doomed"); t.start(); t.join()
raise RuntimeError("uncaught")
"""


@pytest.mark.parametrize("fmt", [LogFormat.JSON, LogFormat.TEXT])
def test_json_covers_every_logger_of_the_process(fmt: LogFormat) -> None:
    program = JSON_PROCESS.replace("LogFormat.JSON", f"LogFormat.{fmt.name}")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    lines = proc.stderr.splitlines()
    if fmt is LogFormat.TEXT:  # the default: as it always was, not JSON
        assert not any(line.startswith("{") for line in lines), proc.stderr
        assert any(TEXT_LINE.match(line) and "from the engine" in line for line in lines)
        return
    parsed = [json.loads(line) for line in lines]  # every line, or this fails
    by_logger = {d["logger"]: d for d in parsed}
    assert by_logger["server.engine"]["message"] == "from the engine"
    assert by_logger["some.library"]["level"] == "WARNING"
    assert by_logger["uvicorn.error"]["message"] == "from uvicorn"
    assert by_logger["uvicorn.access"]["status"] == 200
    assert "a warning" in by_logger["py.warnings"]["message"]
    crashes = [d for d in parsed if d["level"] == "CRITICAL"]
    assert any("ZeroDivisionError" in d["exception"] and "doomed" in d["message"]
               for d in crashes)
    assert any("RuntimeError: uncaught" in d["exception"] for d in crashes)


def test_the_flags() -> None:
    def cfg(*flags: str) -> LoggingConfig:
        args = build_parser().parse_args(["serve", *flags])
        return server_config_from_args(args, environ={}).logging

    assert cfg() == LoggingConfig()  # text, no request logs, stats every 10 s
    assert cfg().stats_interval == 10.0 and cfg("--disable-log-stats").stats_interval is None
    assert cfg("--log-format", "json").log_format is LogFormat.JSON
    assert not cfg("--disable-log-requests").enable_log_requests  # vLLM's spelling of the default
    logged = cfg("--enable-log-requests", "--log-prompts", "--max-log-len", "8")
    assert logged.log_prompts and logged.max_log_len == 8
    with pytest.raises(SystemExit):
        cfg("--enable-log-requests", "--disable-log-requests")
    with pytest.raises(SystemExit):
        cfg("--log-format", "xml")
    with pytest.raises(ValueError, match="--log-prompts needs --enable-log-requests"):
        cfg("--log-prompts")
    env = build_parser().parse_args(["serve"])
    interval = server_config_from_args(env, environ={"VLLM_LOG_STATS_INTERVAL": "2"})
    assert interval.logging.stats_interval == 2.0


class FakeCounters:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.registry = CollectorRegistry()
        self.misses = Counter("hpu_serve:bucket_misses", "", ["phase"], registry=self.registry)
        self.compiled = 0

    def compilations(self, phase: object = None, stage: object = None) -> int:
        return self.compiled


def output(new: int, generated: int, prompt: int = 5) -> RequestOutput:
    return RequestOutput("r", None, list(range(prompt)),
                         [CompletionOutput(0, token_ids=[1] * new)], False,
                         num_generated_tokens=generated)


def test_the_stats_line_comes_when_something_ran_and_carries_the_figures() -> None:
    state = SimpleNamespace(stats=EngineStats(0, 0, 100, 100, 0.0, 0))
    counters = FakeCounters()
    log = StatsLog(10.0, lambda: state.stats, counters)
    last, last_state, fields = log.line(None, None)
    assert fields is None  # the baseline
    last, last_state, fields = log.line(last, last_state)
    assert fields is None  # idle: no line
    log.count([output(1, 1), output(1, 2)])  # a first token (prompt done), then one more
    state.stats = EngineStats(2, 1, 90, 100, 0.1, 0, prefix_cache_queries=10,
                              prefix_cache_hits=4)
    counters.misses.labels("decode").inc()
    counters.compiled = 3
    last, last_state, fields = log.line(last, last_state)
    assert fields is not None
    assert fields["running"] == 2 and fields["waiting"] == 1
    assert fields["kv_cache_usage"] == 0.1 and fields["prefix_cache_hit_rate"] == 0.4
    assert fields["compilations"] == 3 and fields["bucket_misses"] == 1
    assert fields["generation_throughput"] > 0 and fields["prompt_throughput"] > 0
    assert log.prompt_tokens == 5 and log.generation_tokens == 2
    state.stats = EngineStats(0, 0, 100, 100, 0.0, 0, prefix_cache_queries=10,
                              prefix_cache_hits=4)
    last, last_state, fields = log.line(last, last_state)
    assert fields is not None and fields["running"] == 0  # the drop to idle is one line
    assert log.line(last, last_state)[2] is None  # then silence
