"""The Intel Gaudi platform (``habana_frameworks``): HPU graphs in lazy mode, the
``hpu_backend`` compiler in eager mode, HCCL for tensor parallelism.

The only module that imports the Habana bridge; importing it never requires the bridge.
"""

from __future__ import annotations

import importlib.util

import torch

from server.config import DeviceConfig, ExecutionMode
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import (
    CompiledRunner,
    EagerRunner,
    ForwardFn,
    ForwardInputs,
    GraphRunner,
)
from server.hpu.platform import Platform
from server.hpu.types import Bucket, Phase


class HpuLazyRunner(GraphRunner):
    """Gaudi lazy mode (``PT_HPU_LAZY_MODE=1``): ops accumulate until ``mark_step`` and each
    new shape compiles a recipe, so every bucket is warmed even without graphs. With graphs
    the model is wrapped in HPU graphs, which record each shape on its first run: every
    warmed bucket is then replayed as a graph. Compilations are read from the bridge's
    ``graph_compilation`` metric."""

    def __init__(self, forward: ForwardFn, counters: DeviceCounters, module: torch.nn.Module,
                 use_graphs: bool) -> None:
        super().__init__(forward, counters)
        import habana_frameworks.torch as htorch
        from habana_frameworks.torch.hpu.metrics import metric_global

        self.mode = ExecutionMode.GRAPHS if use_graphs else ExecutionMode.EAGER
        self.description = "HPU graphs" if use_graphs else "HPU lazy mode"
        self._htorch = htorch
        self._metric = metric_global("graph_compilation")
        if use_graphs:
            htorch.hpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        before = dict(self._metric.stats()).get("TotalNumber", 0)
        out = self.forward(inputs)
        self._htorch.core.mark_step()
        after = dict(self._metric.stats()).get("TotalNumber", 0)
        if after > before:
            self.counters.compiled(phase, int(after - before))
        return out


class HpuPlatform(Platform):
    """Gaudi, as the reference runs it: ``PT_HPU_LAZY_MODE`` x ``--enforce-eager`` decide
    (lazy + graphs = HPU graphs, lazy + eager = lazy mode, non-lazy = ``torch.compile``
    with ``hpu_backend``, or eager)."""

    name = "hpu"
    dist_backend = "hccl"
    default_mode = ExecutionMode.GRAPHS
    supported_modes = frozenset({ExecutionMode.EAGER, ExecutionMode.COMPILE,
                                 ExecutionMode.GRAPHS})

    def free_memory_bytes(self) -> tuple[int, int]:
        import habana_frameworks.torch as htorch  # noqa: F401 - registers torch.hpu

        free, total = torch.hpu.mem_get_info()  # type: ignore[attr-defined]
        return int(free), int(total)

    def resolve_mode(self, cfg: DeviceConfig) -> ExecutionMode:
        # Graphs vs compile follows the bridge's mode, not the flag, as in the reference.
        if cfg.enforce_eager or cfg.execution_mode is ExecutionMode.EAGER:
            return ExecutionMode.EAGER
        return ExecutionMode.GRAPHS if cfg.hpu_lazy_mode else ExecutionMode.COMPILE

    def graph_runner(self, mode: ExecutionMode, forward: ForwardFn, counters: DeviceCounters,
                     model: torch.nn.Module, cfg: DeviceConfig) -> GraphRunner:
        if cfg.hpu_lazy_mode:  # lazy mode compiles recipes even without graphs: count them
            return HpuLazyRunner(forward, counters, model,
                                 use_graphs=mode is ExecutionMode.GRAPHS)
        if mode is ExecutionMode.EAGER:
            return EagerRunner(forward, counters)
        return CompiledRunner(forward, counters, backend="hpu_backend")


def hpu_plugin() -> HpuPlatform | None:
    return HpuPlatform(torch.device("hpu")) if _hpu_available() else None


def _hpu_available() -> bool:
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        import habana_frameworks.torch.hpu as hthpu

        return bool(hthpu.is_available())
    except Exception:  # a broken vendor install must not stop CPU/CUDA serving
        return False
