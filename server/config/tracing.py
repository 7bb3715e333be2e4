"""OpenTelemetry tracing of requests: where spans go (``--otlp-traces-endpoint``) and how.

The OTLP exporter reads the rest of the standard ``OTEL_*`` variables itself
(``OTEL_EXPORTER_OTLP_TRACES_INSECURE``, ``..._HEADERS``, ``..._TIMEOUT``,
``OTEL_BSP_*``...); the ones this server must know before the SDK is built are fields here.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

from server.config.fields import flag, knob

TRACING = "tracing (OpenTelemetry; needs hpu-serve[otel])"

# what each OTLP transport needs installed (importable names), beyond the SDK
_SDK = "opentelemetry.sdk"
# vLLM's --collect-detailed-traces values
DETAILED_TRACES = ("all", "model", "worker")


class OtlpProtocol(str, enum.Enum):
    """The OTLP transport of the span exporter (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``);
    gRPC is vLLM's default."""

    GRPC = "grpc"
    HTTP_PROTOBUF = "http/protobuf"

    def __str__(self) -> str:
        return self.value

    @property
    def exporter_module(self) -> str:
        """The package that exports spans over this transport."""
        kind = "grpc" if self is OtlpProtocol.GRPC else "http"
        return f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """One span per request to an OTLP endpoint; off unless an endpoint is set."""

    otlp_traces_endpoint: str | None = flag(
        None, env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", group=TRACING, metavar="URL",
        help="export one OpenTelemetry span per request to this OTLP collector (gRPC: "
             "http://host:4317; http/protobuf: http://host:4318/v1/traces). Unset: no "
             "tracing, and nothing of the OpenTelemetry SDK is loaded")
    collect_detailed_traces: str | None = flag(
        None, group=TRACING, metavar="all|model|worker",
        help="vLLM's detailed-trace modules (comma-separated); accepted for compatibility: "
             "the request span always holds the per-phase times this server measures")
    protocol: OtlpProtocol = knob(
        OtlpProtocol.GRPC, env="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        help="OTLP transport of the span exporter: grpc or http/protobuf")
    service_name: str = knob("hpu-serve", env="OTEL_SERVICE_NAME",
                             help="service.name of the exported spans")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_traces_endpoint)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "protocol", OtlpProtocol(self.protocol))
        except ValueError:
            allowed = ", ".join(p.value for p in OtlpProtocol)
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {allowed}, "
                             f"got {self.protocol!r}") from None
        if self.collect_detailed_traces is not None:
            if not self.enabled:
                raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
            wrong = {m.strip() for m in self.collect_detailed_traces.split(",")} - set(
                DETAILED_TRACES)
            if wrong:
                raise ValueError(f"--collect-detailed-traces: unknown {sorted(wrong)}; "
                                 f"allowed: {', '.join(DETAILED_TRACES)}")
        # checked here so that a missing optional package fails before any loading
        if self.enabled and not all(_installed(m) for m in (_SDK, self.protocol.exporter_module)):
            raise ValueError(
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP "
                f"{self.protocol.value} exporter: pip install 'hpu-serve[otel]'")


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
