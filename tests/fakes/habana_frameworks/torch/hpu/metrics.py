"""``habana_frameworks.torch.hpu.metrics``: the bridge's global metrics."""

from __future__ import annotations

from collections.abc import Sequence

from habana_frameworks import standin


class GraphCompilationMetric:
    """``graph_compilation``: every graph (recipe) the bridge compiled, with the time."""

    def name(self) -> str:
        return "graph_compilation"

    def stats(self) -> Sequence[tuple[str, float]]:
        number = standin.DEVICE.compilations
        total = standin.DEVICE.compile_seconds
        return [("TotalNumber", number), ("TotalTime", total),
                ("AvgTime", total / number if number else 0)]


def _reference_metric_global(name):  # noqa: ANN001, ANN202 - the bridge's
    ...


@standin.documented("hpu.metrics.metric_global", _reference_metric_global)
def metric_global(name: str) -> GraphCompilationMetric | None:
    """The global metric of that name, or None (the bridge knows ``graph_compilation``)."""
    return GraphCompilationMetric() if name == "graph_compilation" else None
