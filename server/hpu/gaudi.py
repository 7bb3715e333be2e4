"""The Intel Gaudi platform (``habana_frameworks``): HPU graphs in lazy mode, the
``hpu_backend`` compiler in eager mode, HCCL for tensor parallelism.

The only module that imports the Habana bridge; importing it never requires the bridge.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import fields
from typing import TypeVar

import torch

from server.config import DeviceConfig, ExecutionMode
from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import (
    CompiledRunner,
    EagerRunner,
    ForwardFn,
    ForwardInputs,
    GraphRunner,
)
from server.hpu.platform import Platform
from server.hpu.state_cache import StateInputs
from server.hpu.types import Bucket, CompileLabel, Phase, SyncPoint

T = TypeVar("T")


# AttentionMetadata's tensor fields, in order; the others (is_prompt, block_size) are plain
# values that select the graph.
_META_TENSORS = tuple(f.name for f in fields(AttentionMetadata)
                      if f.name not in ("is_prompt", "block_size"))
FlatInputs = tuple[tuple[torch.Tensor | None, ...], tuple[bool, int]]


def flatten_inputs(inputs: ForwardInputs) -> FlatInputs:
    """A step's inputs as the bridge can take them: a tuple of tensors and a tuple of plain
    values. HPU graphs are keyed by hashing the call's arguments (a dataclass is not
    hashable) and on replay only tensors reached through tuples, lists and dicts are copied
    into the captured graph: tensors inside an object would keep their captured values."""
    meta = inputs.meta
    state = inputs.state.tensors() if inputs.state is not None else (None,) * 3
    tensors = (inputs.input_ids, inputs.positions, inputs.logits_indices, inputs.lora_slots,
               *state, inputs.mm_embeds, inputs.mm_mask, inputs.spec_slots,
               *(getattr(meta, name) for name in _META_TENSORS))
    return tensors, (meta.is_prompt, meta.block_size)


def unflatten_inputs(tensors: tuple[torch.Tensor | None, ...],
                     static: tuple[bool, int]) -> ForwardInputs:
    (input_ids, positions, logits_indices, lora_slots, slots, lens, has, mm_embeds, mm_mask,
     spec_slots, *meta_tensors) = tensors
    assert input_ids is not None and positions is not None and logits_indices is not None
    meta = AttentionMetadata(static[0], static[1],
                             **dict(zip(_META_TENSORS, meta_tensors)))  # type: ignore[arg-type]
    # hybrid models' state slots (server/hpu/state_cache.py)
    state = (StateInputs(slots, lens, has) if slots is not None and lens is not None
             and has is not None else None)
    return ForwardInputs(input_ids, positions, meta, logits_indices, input_ids.shape[0],
                         lora_slots, state, mm_embeds=mm_embeds, mm_mask=mm_mask,
                         spec_slots=spec_slots)


class ForwardModule(torch.nn.Module):
    """The step's forward as the module HPU graphs wrap, taking :func:`flatten_inputs`."""

    def __init__(self, forward: ForwardFn) -> None:
        super().__init__()
        self.step_forward = forward

    def forward(self, tensors: tuple[torch.Tensor | None, ...],
                static: tuple[bool, int]) -> torch.Tensor:
        return self.step_forward(unflatten_inputs(tensors, static))


class HpuLazyRunner(GraphRunner):
    """Gaudi lazy mode (``PT_HPU_LAZY_MODE=1``), as the reference runs it: ops accumulate
    until ``mark_step``, each new shape compiles a recipe, so every bucket is warmed (run
    once, outside graphs) before serving; with graphs, warmup then captures HPU graphs
    within the ``VLLM_GRAPH_RESERVED_MEM`` budget and buckets left uncaptured keep running
    outside graphs (``bypass_hpu_graphs``). Compilations are read from the bridge's
    ``graph_compilation`` metric around each step."""

    mode = ExecutionMode.GRAPHS  # or EAGER (lazy mode without graphs): set per instance
    description = "HPU graphs"
    captures_graphs = True

    def __init__(self, forward: ForwardFn, counters: DeviceCounters, use_graphs: bool) -> None:
        super().__init__(forward, counters)
        import habana_frameworks.torch as htorch
        from habana_frameworks.torch.hpu.metrics import metric_global

        self.mode = ExecutionMode.GRAPHS if use_graphs else ExecutionMode.EAGER
        self.description = "HPU graphs" if use_graphs else "HPU lazy mode"
        self.captures_graphs = use_graphs
        self._mark_step = htorch.core.mark_step
        self._metric = metric_global("graph_compilation")
        # Wrapped even without graphs: a bypassed call is the module run as is, and the
        # bridge's graph tooling sees every step either way.
        self._module = htorch.hpu.wrap_in_hpu_graph(ForwardModule(forward),
                                                    disable_tensor_cache=True)
        self._captured: set[tuple[Phase, Bucket]] = set()

    def warm(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self._step(phase, inputs, use_graph=False)  # the recipe; a graph comes with capture
        self.warmed[phase].add(bucket)

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self._step(phase, inputs, use_graph=True)  # the first graphed run records the graph
        self._captured.add((phase, bucket))

    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        return (phase, bucket) in self._captured

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        return self._step(phase, inputs, use_graph=self.can_replay(phase, bucket))

    def sync(self, point: SyncPoint) -> None:
        """Closes the lazy graph of the work issued since the last step (sampling)."""
        self._counted(point, lambda: None)

    def _step(self, phase: Phase, inputs: ForwardInputs, use_graph: bool) -> torch.Tensor:
        tensors, static = flatten_inputs(inputs)
        return self._counted(phase, lambda: self._module(tensors, static,
                                                          bypass_hpu_graphs=not use_graph))

    def _counted(self, phase: CompileLabel, work: Callable[[], T]) -> T:
        before = self._compilations()
        out = work()
        self._mark_step()
        after = self._compilations()
        if after > before:
            self.counters.compiled(phase, int(after - before))
        return out

    def _compilations(self) -> float:
        return dict(self._metric.stats()).get("TotalNumber", 0)


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

    def prepare_rank(self, rank: int, world_size: int) -> None:
        # The HCCL backend of torch.distributed exists once this module is imported. Each
        # process is given its own module by the runtime (HABANA_VISIBLE_MODULES limits
        # which): the device stays plain "hpu", as vLLM Gaudi's workers use it.
        del rank
        if world_size > 1:
            import habana_frameworks.torch.distributed.hccl  # noqa: F401

    def resolve_mode(self, cfg: DeviceConfig) -> ExecutionMode:
        # Graphs vs compile follows the bridge's mode, not the flag, as in the reference.
        if cfg.enforce_eager or cfg.execution_mode is ExecutionMode.EAGER:
            return ExecutionMode.EAGER
        return ExecutionMode.GRAPHS if cfg.hpu_lazy_mode else ExecutionMode.COMPILE

    def graph_runner(self, mode: ExecutionMode, forward: ForwardFn, counters: DeviceCounters,
                     model: torch.nn.Module, cfg: DeviceConfig) -> GraphRunner:
        if cfg.hpu_lazy_mode:  # lazy mode compiles recipes even without graphs: count them
            return HpuLazyRunner(forward, counters, use_graphs=mode is ExecutionMode.GRAPHS)
        if mode is ExecutionMode.EAGER:
            return EagerRunner(forward, counters)
        import habana_frameworks.torch  # noqa: F401 - registers the hpu_backend compiler

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
