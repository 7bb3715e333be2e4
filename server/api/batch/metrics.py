"""``run-batch --enable-metrics``: Prometheus' own HTTP server on --host / --port from before
the model loads (a scraper sees the process up at once); the app's series join it once the
app exists."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class LateRegistry(Collector):
    """The series of a registry handed over later (none until then)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry | None = None

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect() if self.registry is not None else iter(())


def serve_metrics(host: str, port: int) -> LateRegistry:
    """Starts the metrics server (a daemon thread: it ends with the run)."""
    late = LateRegistry()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(late)
    start_http_server(port, addr=host, registry=registry)
    return late
