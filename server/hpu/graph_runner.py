"""Executing the model on pre-planned shapes: one small interface, one backend per mode.

``run(phase, key, inputs)`` executes a padded batch; ``warm(phase, key, inputs)`` compiles or
captures that shape ahead of serving. Keys are bucket tuples, so a backend never sees a
shape it was not told about unless the batch missed every bucket.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardInputs:
    """Device tensors of one padded batch; every shape is fixed by its bucket."""

    input_ids: torch.Tensor  # [bs, q]
    positions: torch.Tensor  # [bs, q]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [bs] flat index of each row's last token (pads: 0)
    num_seqs: int  # real rows; the rest is padding


ForwardFn = Callable[[ForwardInputs], torch.Tensor]
BucketKey = tuple[int, ...]


class GraphRunner(ABC):
    """Runs ``forward`` for padded batches; subclasses decide how shapes become graphs."""

    mode = "abstract"

    def __init__(self, forward: ForwardFn, counters: DeviceCounters) -> None:
        self.forward = forward
        self.counters = counters
        self.warmed: dict[str, set[BucketKey]] = {"prompt": set(), "decode": set()}

    def warm(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> None:
        """Compile (and where the backend can, capture) one bucket before serving."""
        self.run(phase, key, inputs)
        self.warmed[phase].add(key)

    @abstractmethod
    def run(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> torch.Tensor: ...

    @property
    def captures_graphs(self) -> bool:
        return False


class EagerRunner(GraphRunner):
    """``--enforce-eager``: plain PyTorch, no graphs."""

    mode = "eager"

    def run(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> torch.Tensor:
        return self.forward(inputs)


class CompiledRunner(GraphRunner):
    """``torch.compile`` with static shapes: each new bucket shape is one real compilation,
    counted when dynamo hands a graph to the backend (torch's own compile event)."""

    mode = "compiled"

    def __init__(self, forward: ForwardFn, counters: DeviceCounters, backend: str = "inductor",
                 max_shapes: int = 512, regions: list[torch.nn.Module] | None = None) -> None:
        super().__init__(forward, counters)
        import torch._dynamo

        # One cache entry per bucket shape: the default limit (8) would silently fall back
        # to eager after a handful of buckets.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    max_shapes)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, max_shapes)
        self._backend = backend
        self._phase = "prompt"
        if regions:
            # Regional compilation: identical layers share one compiled graph per shape, so
            # warmup compiles a layer, not the whole model, per bucket.
            for region in regions:
                region.compile(backend=self._counting_backend, dynamic=False)
            self._compiled = forward
        else:
            self._compiled = torch.compile(forward, backend=self._counting_backend,
                                           dynamic=False)

    def _counting_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.counters.compiled(self._phase)
        logger.debug("compiling %s graph (%d nodes)", self._phase, len(gm.graph.nodes))
        if self._backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self._backend)(gm, example_inputs)

    def run(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> torch.Tensor:
        self._phase = phase
        return self._compiled(inputs)


class CudaGraphRunner(GraphRunner):
    """One ``torch.cuda.CUDAGraph`` per bucket over static input buffers, all graphs sharing
    one memory pool; buckets not captured (budget spent) run eagerly."""

    mode = "cuda_graphs"

    def __init__(self, forward: ForwardFn, counters: DeviceCounters) -> None:
        super().__init__(forward, counters)
        self._graphs: dict[tuple[str, BucketKey], tuple[Any, ForwardInputs, torch.Tensor]] = {}
        self._pool: Any = None

    @property
    def captures_graphs(self) -> bool:
        return True

    def capture(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> None:
        static = _clone_inputs(inputs)
        self.forward(static)  # allocator and kernels settle before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.forward(static)
        self._graphs[(phase, key)] = (graph, static, output)
        self.counters.compiled(phase)

    def run(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> torch.Tensor:
        entry = self._graphs.get((phase, key))
        if entry is None:
            return self.forward(inputs)
        graph, static, output = entry
        _copy_inputs(static, inputs)
        graph.replay()
        return output.clone()


class HpuGraphRunner(GraphRunner):
    """Gaudi lazy mode: the model wrapped in HPU graphs (one per input shape); compilations
    are read from the bridge's ``graph_compilation`` metric."""

    mode = "hpu_graphs"

    def __init__(self, forward: ForwardFn, counters: DeviceCounters, module: torch.nn.Module,
                 use_graphs: bool) -> None:
        super().__init__(forward, counters)
        import habana_frameworks.torch as htorch
        from habana_frameworks.torch.hpu.metrics import metric_global

        self._htorch = htorch
        self._metric = metric_global("graph_compilation")
        if use_graphs:
            htorch.hpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)

    @property
    def captures_graphs(self) -> bool:
        return True

    def run(self, phase: str, key: BucketKey, inputs: ForwardInputs) -> torch.Tensor:
        before = dict(self._metric.stats()).get("TotalNumber", 0)
        out = self.forward(inputs)
        self._htorch.core.mark_step()
        after = dict(self._metric.stats()).get("TotalNumber", 0)
        if after > before:
            self.counters.compiled(phase, int(after - before))
        return out


def _clone_inputs(inputs: ForwardInputs) -> ForwardInputs:
    meta = AttentionMetadata(**{
        f.name: (v.clone() if isinstance(v := getattr(inputs.meta, f.name), torch.Tensor) else v)
        for f in fields(AttentionMetadata)
    })
    return ForwardInputs(inputs.input_ids.clone(), inputs.positions.clone(), meta,
                         inputs.logits_indices.clone(), inputs.num_seqs)


def _copy_inputs(dst: ForwardInputs, src: ForwardInputs) -> None:
    dst.input_ids.copy_(src.input_ids)
    dst.positions.copy_(src.positions)
    dst.logits_indices.copy_(src.logits_indices)
    for f in fields(AttentionMetadata):
        value = getattr(dst.meta, f.name)
        if isinstance(value, torch.Tensor):
            value.copy_(getattr(src.meta, f.name))


def select_runner(platform: str, mode: str, enforce_eager: bool, forward: ForwardFn,
                  counters: DeviceCounters, module: torch.nn.Module,
                  hpu_lazy_mode: bool = True) -> GraphRunner:
    """The execution-mode table. HPU follows the reference (PT_HPU_LAZY_MODE x
    --enforce-eager): lazy + graphs = HPU graphs, lazy + eager = lazy mode, non-lazy + graphs
    = torch.compile, non-lazy + eager = eager. ``auto`` elsewhere: CUDA graphs on CUDA, eager
    on CPU (with the fused kernels, measured 1.6-3.1x faster per decode step than compiled
    graphs, which also cost minutes of compilation; ``--execution-mode compile`` opts in)."""
    eager = enforce_eager or mode == "eager"
    if platform == "hpu":
        if hpu_lazy_mode:  # lazy mode compiles recipes even without graphs: count them
            return HpuGraphRunner(forward, counters, module, use_graphs=not eager)
        return EagerRunner(forward, counters) if eager else CompiledRunner(
            forward, counters, backend="hpu_backend")
    if eager:
        return EagerRunner(forward, counters)
    if platform == "cuda" and mode in ("auto", "graphs"):
        return CudaGraphRunner(forward, counters)
    if mode == "auto" and platform == "cpu":
        return EagerRunner(forward, counters)
    return CompiledRunner(forward, counters, regions=list(getattr(module, "layers", [])) or None)
