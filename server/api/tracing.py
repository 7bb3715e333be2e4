"""One OpenTelemetry span per request (``--otlp-traces-endpoint``), with vLLM's attribute
names, made when the request finishes from the engine's timestamps.

The span joins the caller's trace when the request carried a W3C ``traceparent``. Nothing of
the OpenTelemetry SDK is imported unless tracing is on: this module imports it inside
:meth:`RequestTracer.from_config` and :meth:`RequestTracer.finished` only. The tracer
provider is this server's own, not the global one: FastAPI instruments itself through the
global provider, and a request must make one span, not one per middleware layer. Spans leave
through a ``BatchSpanProcessor``: its thread, never the event loop, talks to the collector.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from server.config import OtlpProtocol, TracingConfig
from server.engine.outputs import RequestMetrics, RequestOutput
from server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

# the W3C trace-context headers a request may carry (what the span joins)
TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"  # vLLM's
INSTRUMENTATION = "hpu_serve.api"


class SpanAttributes:
    """Attribute names of the request span: vLLM's (the OpenTelemetry GenAI conventions where
    they exist, vLLM's additions where not), then this server's own."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_N = "gen_ai.request.n"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # hpu-serve's own
    BUCKETS = "hpu_serve.buckets"  # "phase:batch,query,blocks" of the steps it ran in
    NUM_PREEMPTIONS = "hpu_serve.num_preemptions"
    PROMPT_INDEX = "hpu_serve.prompt_index"  # which prompt of a multi-prompt completions call
    ERROR = "hpu_serve.error"


# one request's span, made when its last output arrives
TraceHook = Callable[[RequestOutput], None]


class RequestTracer:
    """Makes the span of each finished request on ``provider`` (this server's own)."""

    def __init__(self, provider: TracerProvider, model_name: str) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.model_name = model_name
        self._tracer = provider.get_tracer(INSTRUMENTATION)
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    @classmethod
    def from_config(cls, cfg: TracingConfig, model_name: str,
                    exporter: SpanExporter | None = None) -> RequestTracer | None:
        """The tracer exporting to ``cfg``'s endpoint (or to ``exporter``); None when tracing
        is off. The exporter reads its other ``OTEL_EXPORTER_OTLP_*`` settings itself."""
        if not cfg.enabled and exporter is None:
            return None
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            if exporter is None:
                exporter = _otlp_exporter(cfg)
        except ImportError as exc:
            raise RuntimeError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK: pip "
                               f"install 'hpu-serve[otel]' ({exc})") from exc
        # shut down (queued spans flushed) at interpreter exit
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: cfg.service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, model_name)

    def hook(self, request_id: str, trace_headers: Mapping[str, str],
             params: SamplingParams, prompt_index: int | None = None) -> TraceHook:
        """What the request's stream calls with its final output."""
        return lambda out: self.finished(out, request_id, trace_headers, params, prompt_index)

    def finished(self, out: RequestOutput, request_id: str, trace_headers: Mapping[str, str],
                 params: SamplingParams, prompt_index: int | None = None) -> None:
        """Records the finished request ``out`` as one span, in the caller's trace if
        ``trace_headers`` hold a valid ``traceparent``. Never raises: the answer matters
        more than its trace."""
        try:
            self._record(out, request_id, trace_headers, params, prompt_index)
        except Exception:  # noqa: BLE001 - logged; the request goes on
            logger.exception("request %s: its span could not be recorded", request_id)

    def _record(self, out: RequestOutput, request_id: str, trace_headers: Mapping[str, str],
                params: SamplingParams, prompt_index: int | None) -> None:
        metrics = out.metrics
        attributes = request_attributes(out, request_id, self.model_name, params, prompt_index)
        # the engine's clock is monotonic; spans take wall-clock nanoseconds
        offset = time.time() - time.monotonic()
        now = time.monotonic()
        start = metrics.arrival_time if metrics is not None else now
        end = metrics.finished_time if metrics is not None and metrics.finished_time else now
        span = self._tracer.start_span(
            SPAN_NAME, context=self._propagator.extract(trace_headers),
            kind=self._server_kind, attributes=attributes,
            start_time=_ns(start + offset))
        if out.error is not None:
            from opentelemetry.trace import Status, StatusCode
            span.set_status(Status(StatusCode.ERROR, out.error))
        span.end(end_time=_ns(end + offset))

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter's thread."""
        self.provider.shutdown()


def request_attributes(out: RequestOutput, request_id: str, model_name: str,
                       params: SamplingParams, prompt_index: int | None = None
                       ) -> dict[str, Any]:
    """The span's attributes for the finished request ``out`` (None values left out)."""
    a = SpanAttributes
    attrs: dict[str, Any] = {
        a.REQUEST_ID: request_id,
        a.RESPONSE_MODEL: model_name,
        a.REQUEST_TEMPERATURE: params.temperature,
        a.REQUEST_TOP_P: params.top_p,
        a.REQUEST_MAX_TOKENS: params.max_tokens,
        a.REQUEST_N: params.n,
        a.USAGE_NUM_SEQUENCES: len(out.outputs),
        a.USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
        a.USAGE_COMPLETION_TOKENS: out.num_generated_tokens,
        a.RESPONSE_FINISH_REASONS: [c.finish_reason or "abort" for c in out.outputs],
        a.PROMPT_INDEX: prompt_index,
        a.ERROR: out.error,
    }
    if out.metrics is not None:
        attrs.update(_latencies(out.metrics))
        attrs[a.BUCKETS] = list(out.metrics.buckets)
        attrs[a.NUM_PREEMPTIONS] = out.metrics.num_preemptions
    return {k: v for k, v in attrs.items() if v is not None}


def _latencies(m: RequestMetrics) -> dict[str, float | None]:
    """vLLM's latency attributes, in seconds, from the engine's timestamps (a request that
    never ran, or never produced a token, lacks the ones that need it)."""
    a = SpanAttributes

    def since(begin: float | None, end: float | None) -> float | None:
        return None if begin is None or end is None else end - begin

    return {
        a.LATENCY_TIME_IN_QUEUE: since(m.arrival_time, m.first_scheduled_time),
        a.LATENCY_TIME_TO_FIRST_TOKEN: since(m.arrival_time, m.first_token_time),
        a.LATENCY_E2E: since(m.arrival_time, m.finished_time),
        a.LATENCY_TIME_IN_MODEL_PREFILL: since(m.first_scheduled_time, m.first_token_time),
        a.LATENCY_TIME_IN_MODEL_DECODE: since(m.first_token_time, m.last_token_time),
        a.LATENCY_TIME_IN_MODEL_INFERENCE: since(m.first_scheduled_time, m.last_token_time),
    }


def _otlp_exporter(cfg: TracingConfig) -> SpanExporter:
    """The OTLP span exporter of ``cfg.protocol``, sending to ``cfg``'s endpoint."""
    if cfg.protocol is OtlpProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(endpoint=cfg.otlp_traces_endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )
    return HttpSpanExporter(endpoint=cfg.otlp_traces_endpoint)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def trace_headers_of(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The W3C trace-context headers of a request, as the span will read them."""
    return tuple((name, headers[name]) for name in TRACE_HEADERS if name in headers)
