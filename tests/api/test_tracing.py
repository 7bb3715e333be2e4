"""Request tracing (``--otlp-traces-endpoint``): one span per request with vLLM's attribute
names and the buckets it ran in, joined to the caller's trace by ``traceparent``.

Unit tests run the app over a scripted engine into the SDK's in-memory exporter; the
end-to-end test starts a real OTLP/gRPC receiver (the collector's TraceService) and a real
``python -m server serve`` exporting to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_process import TINY_FLAGS, start_server

from server.api.app import build_app
from server.api.tracing import RequestTracer, SpanAttributes
from server.config import ServerConfig, TracingConfig
from server.engine.outputs import MAX_REQUEST_BUCKETS, RequestMetrics, RequestOutput
from server.engine.sampling_params import SamplingParams

pytest.importorskip("opentelemetry.sdk", reason="pip install 'hpu-serve[otel]'")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

ROOT = Path(__file__).resolve().parents[2]
A = SpanAttributes
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
BUCKETS = ("prefill:1,16,0", "decode:1,1,1")


class TimedEngine(FakeEngine):
    """The scripted engine, with the timestamps and buckets a real engine step records."""

    async def _outputs(self, request_id: str, prompt: str | list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        t0 = time.monotonic()
        async for out in super()._outputs(request_id, prompt, params):
            out.metrics = RequestMetrics(
                arrival_time=t0, first_scheduled_time=t0 + 0.1, first_token_time=t0 + 0.3,
                last_token_time=t0 + 0.5, finished_time=t0 + 0.5 if out.finished else None,
                buckets=BUCKETS)
            yield out


@pytest.fixture()
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture()
def client(exporter: InMemorySpanExporter) -> Iterator[TestClient]:
    engine = TimedEngine()
    tracer = RequestTracer.from_config(TracingConfig(), engine.model_name, exporter)
    assert tracer is not None
    with TestClient(build_app(engine, ServerConfig(), tracer)) as client:
        yield client
    tracer.shutdown()  # flushes the batch processor into the exporter


def finished_spans(client: TestClient, exporter: InMemorySpanExporter) -> list[Any]:
    tracer = client.app.state.ctx.tracer
    tracer.provider.force_flush()
    return list(exporter.get_finished_spans())


def test_one_span_per_request_with_vllm_attributes(client: TestClient,
                                                  exporter: InMemorySpanExporter) -> None:
    resp = client.post("/v1/chat/completions", headers={"X-Request-Id": "chat-1"}, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
        "temperature": 0.5, "top_p": 0.9, "n": 2})
    assert resp.status_code == 200, resp.text
    spans = finished_spans(client, exporter)
    assert len(spans) == 1
    span = spans[0]
    assert span.name == "llm_request"
    attrs = dict(span.attributes)
    assert attrs[A.REQUEST_ID] == "chat-1"
    assert attrs[A.RESPONSE_MODEL] == "fake-model"
    assert attrs[A.REQUEST_TEMPERATURE] == 0.5
    assert attrs[A.REQUEST_TOP_P] == 0.9
    assert attrs[A.REQUEST_MAX_TOKENS] == 5
    assert attrs[A.REQUEST_N] == 2
    assert attrs[A.USAGE_PROMPT_TOKENS] == 5
    assert attrs[A.USAGE_COMPLETION_TOKENS] == 10
    assert list(attrs[A.RESPONSE_FINISH_REASONS]) == ["length", "length"]
    assert attrs[A.LATENCY_TIME_IN_QUEUE] == pytest.approx(0.1)
    assert attrs[A.LATENCY_TIME_TO_FIRST_TOKEN] == pytest.approx(0.3)
    assert attrs[A.LATENCY_E2E] == pytest.approx(0.5)
    assert attrs[A.LATENCY_TIME_IN_MODEL_PREFILL] == pytest.approx(0.2)
    assert attrs[A.LATENCY_TIME_IN_MODEL_DECODE] == pytest.approx(0.2)
    assert tuple(attrs[A.BUCKETS]) == BUCKETS
    # the span lasts from arrival to finish
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(0.5, abs=1e-3)
    # no traceparent: a trace of its own
    assert span.parent is None


def test_traceparent_joins_the_callers_trace(client: TestClient,
                                             exporter: InMemorySpanExporter) -> None:
    resp = client.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                       json={"prompt": "ab", "max_tokens": 3, "stream": True})
    assert resp.status_code == 200, resp.text
    [span] = finished_spans(client, exporter)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.parent.is_remote


def test_a_bad_traceparent_starts_a_new_trace(client: TestClient,
                                              exporter: InMemorySpanExporter) -> None:
    resp = client.post("/v1/completions", headers={"traceparent": "00-nonsense-01"},
                       json={"prompt": "ab", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    [span] = finished_spans(client, exporter)
    assert span.parent is None


def test_each_prompt_of_a_completions_call_is_a_request(client: TestClient,
                                                       exporter: InMemorySpanExporter) -> None:
    resp = client.post("/v1/completions", headers={"X-Request-Id": "multi"},
                       json={"prompt": ["ab", "cde"], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    spans = finished_spans(client, exporter)
    assert sorted(dict(s.attributes)[A.PROMPT_INDEX] for s in spans) == [0, 1]
    assert sorted(dict(s.attributes)[A.USAGE_PROMPT_TOKENS] for s in spans) == [2, 3]
    assert {dict(s.attributes)[A.REQUEST_ID] for s in spans} == {"multi"}


def test_request_buckets_are_distinct_and_bounded() -> None:
    metrics = RequestMetrics(arrival_time=0.0)
    for step in range(3 * MAX_REQUEST_BUCKETS):
        metrics.ran_in("prefill:1,16,0")
        metrics.ran_in(f"decode:1,1,{step}")
    assert metrics.buckets[:2] == ("prefill:1,16,0", "decode:1,1,0")
    assert len(metrics.buckets) == MAX_REQUEST_BUCKETS
    assert len(set(metrics.buckets)) == MAX_REQUEST_BUCKETS


def test_tracing_off_imports_no_sdk() -> None:
    """Without --otlp-traces-endpoint, serving a request loads nothing of the SDK or the
    exporters (FastAPI itself imports the OpenTelemetry API, which is not ours to avoid)."""
    probe = """
import sys
from fastapi.testclient import TestClient
from fake_engine import FakeEngine
from server.api.app import build_app
from server.config import ServerConfig
with TestClient(build_app(FakeEngine(), ServerConfig())) as c:
    r = c.post('/v1/completions', headers={'traceparent': '%s'}, json={'prompt': 'ab'})
    assert r.status_code == 200, r.text
print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk',
             'opentelemetry.exporter', 'grpc'))))
""" % TRACEPARENT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests/api")]))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, env=env, check=True).stdout.strip()
    assert out.splitlines()[-1] == "[]"


def test_missing_sdk_is_a_start_up_error_naming_the_extra() -> None:
    """The flag without the packages: one line naming hpu-serve[otel], before any loading."""
    probe = """
import sys
sys.modules['opentelemetry.sdk'] = None  # as if not installed
from server.cli import main
sys.exit(main(['serve', 'no-such-model', '--otlp-traces-endpoint', 'http://127.0.0.1:9']))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode != 0
    assert "hpu-serve[otel]" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_bad_protocol_and_detailed_traces_are_refused() -> None:
    with pytest.raises(ValueError, match="grpc, http/protobuf"):
        TracingConfig(otlp_traces_endpoint="http://x:4317", protocol="thrift")
    with pytest.raises(ValueError, match="needs --otlp-traces-endpoint"):
        TracingConfig(collect_detailed_traces="all")
    with pytest.raises(ValueError, match="unknown"):
        TracingConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces="gpu")
    assert TracingConfig(otlp_traces_endpoint="http://x:4317",
                         collect_detailed_traces="model,worker").enabled


# --- end to end: a real OTLP receiver, a real server ---------------------------------------


class Receiver:
    """An OTLP/gRPC trace receiver on a loopback port: the collector's TraceService, keeping
    every span it is sent (with the service.name of its resource)."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        received: list[tuple[str, Any]] = []
        lock = threading.Lock()

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
                with lock:
                    for resource_spans in request.resource_spans:
                        service = next((kv.value.string_value for kv in
                                        resource_spans.resource.attributes
                                        if kv.key == "service.name"), "")
                        for scope_spans in resource_spans.scope_spans:
                            received.extend((service, s) for s in scope_spans.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self._received, self._lock = received, lock

    def spans(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._received)

    def wait_for(self, count: int, timeout: float = 30.0) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(self.spans()) < count:
            time.sleep(0.05)
        return self.spans()

    def stop(self) -> None:
        self.server.stop(grace=None)


def attributes_of(span: Any) -> dict[str, Any]:
    """An OTLP span's attributes as Python values (arrays as lists)."""
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)

    return {kv.key: value(kv.value) for kv in span.attributes}


@pytest.mark.slow
def test_spans_reach_a_real_otlp_receiver(tiny_model) -> None:
    pytest.importorskip("grpc")
    receiver = Receiver()
    server = start_server(
        tiny_model[0], *TINY_FLAGS, "--otlp-traces-endpoint",
        f"http://127.0.0.1:{receiver.port}",
        env={"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true", "OTEL_SERVICE_NAME": "e2e-serve",
             "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            plain = http.post("/v1/completions", headers={"X-Request-Id": "plain-1"},
                              json={"prompt": "the quick brown fox", "max_tokens": 6,
                                    "temperature": 0.0, "ignore_eos": True})
            assert plain.status_code == 200, plain.text
            joined = http.post("/v1/chat/completions",
                               headers={"X-Request-Id": "joined-1", "traceparent": TRACEPARENT},
                               json={"messages": [{"role": "user", "content": "hello"}],
                                     "max_tokens": 4, "top_p": 0.5, "stream": True,
                                     "ignore_eos": True})
            assert joined.status_code == 200, joined.text
            spans = receiver.wait_for(2)
            time.sleep(0.5)  # a third span, were there one, would have come by now
            spans = receiver.spans()
    finally:
        server.stop()
        receiver.stop()
    assert len(spans) == 2, [s.name for _, s in spans]
    assert {service for service, _ in spans} == {"e2e-serve"}
    by_id = {attributes_of(s)[A.REQUEST_ID]: s for _, s in spans}
    assert set(by_id) == {"plain-1", "joined-1"}

    plain_attrs = attributes_of(by_id["plain-1"])
    assert plain_attrs[A.RESPONSE_MODEL] == "SmolLM2-135M-Instruct"
    assert plain_attrs[A.USAGE_COMPLETION_TOKENS] == 6
    assert plain_attrs[A.USAGE_PROMPT_TOKENS] > 0
    assert plain_attrs[A.REQUEST_MAX_TOKENS] == 6
    assert plain_attrs[A.REQUEST_TEMPERATURE] == 0.0
    assert plain_attrs[A.RESPONSE_FINISH_REASONS] == ["length"]
    for name in (A.LATENCY_TIME_IN_QUEUE, A.LATENCY_TIME_TO_FIRST_TOKEN, A.LATENCY_E2E,
                 A.LATENCY_TIME_IN_MODEL_PREFILL, A.LATENCY_TIME_IN_MODEL_DECODE):
        assert plain_attrs[name] >= 0.0, name
    assert plain_attrs[A.LATENCY_E2E] >= plain_attrs[A.LATENCY_TIME_TO_FIRST_TOKEN]
    # the engine's steps: its prompt ran in a prefill bucket, its tokens in decode ones
    phases = {b.split(":")[0] for b in plain_attrs[A.BUCKETS]}
    assert phases == {"prefill", "decode"}, plain_attrs[A.BUCKETS]
    assert by_id["plain-1"].parent_span_id == b""  # a trace of its own

    joined_span = by_id["joined-1"]
    assert joined_span.trace_id.hex() == TRACE_ID
    assert joined_span.parent_span_id.hex() == PARENT_SPAN_ID
    assert attributes_of(joined_span)[A.REQUEST_TOP_P] == 0.5
    assert attributes_of(joined_span)[A.USAGE_COMPLETION_TOKENS] == 4
    assert by_id["plain-1"].trace_id.hex() != TRACE_ID
    assert json.dumps(attributes_of(joined_span))  # plain values only
