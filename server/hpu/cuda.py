"""The NVIDIA platform: CUDA graphs per bucket, NCCL for tensor parallelism."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from server.config import DeviceConfig, ExecutionMode
from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import ForwardFn, ForwardInputs, GraphRunner
from server.hpu.platform import Platform
from server.hpu.types import Bucket, Phase


class CudaGraphRunner(GraphRunner):
    """One ``torch.cuda.CUDAGraph`` per bucket over static input buffers, all graphs sharing
    one memory pool; buckets not captured (budget spent) run eagerly."""

    mode = ExecutionMode.GRAPHS
    description = "CUDA graphs"
    captures_graphs = True

    def __init__(self, forward: ForwardFn, counters: DeviceCounters) -> None:
        super().__init__(forward, counters)
        self._graphs: dict[tuple[Phase, Bucket], tuple[Any, ForwardInputs, torch.Tensor]] = {}
        self._pool: Any = None

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        static = _clone_inputs(inputs)
        self.forward(static)  # allocator and kernels settle before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.forward(static)
        self._graphs[(phase, bucket)] = (graph, static, output)
        self.counters.compiled(phase)

    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        return (phase, bucket) in self._graphs

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        entry = self._graphs.get((phase, bucket))
        if entry is None or entry[1].logits_indices.shape != inputs.logits_indices.shape:
            # not captured, or a step asking for more logits rows (prompt logprobs): eager
            return self.forward(inputs)
        graph, static, output = entry
        _copy_inputs(static, inputs)
        graph.replay()
        return output.clone()


def _clone_inputs(inputs: ForwardInputs) -> ForwardInputs:
    meta = AttentionMetadata(**{
        f.name: (v.clone() if isinstance(v := getattr(inputs.meta, f.name), torch.Tensor) else v)
        for f in fields(AttentionMetadata)
    })
    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return ForwardInputs(inputs.input_ids.clone(), inputs.positions.clone(), meta,
                         inputs.logits_indices.clone(), inputs.num_seqs,
                         clone(inputs.lora_slots),
                         None if inputs.state is None else inputs.state.clone(),
                         mm_embeds=clone(inputs.mm_embeds), mm_mask=clone(inputs.mm_mask),
                         spec_slots=clone(inputs.spec_slots))


def _copy_inputs(dst: ForwardInputs, src: ForwardInputs) -> None:
    dst.input_ids.copy_(src.input_ids)
    dst.positions.copy_(src.positions)
    dst.logits_indices.copy_(src.logits_indices)
    if dst.state is not None and src.state is not None:  # hybrid models' state slots
        dst.state.copy_(src.state)
    for name in ("lora_slots", "mm_embeds", "mm_mask", "spec_slots"):  # a vision prefill's image rows
        target, given = getattr(dst, name), getattr(src, name)
        if target is not None and given is not None:
            target.copy_(given)
    for f in fields(AttentionMetadata):
        value = getattr(dst.meta, f.name)
        if isinstance(value, torch.Tensor):
            value.copy_(getattr(src.meta, f.name))


class CudaPlatform(Platform):
    """NVIDIA GPUs: ``auto`` captures one CUDA graph per bucket."""

    name = "cuda"
    dist_backend = "nccl"
    default_mode = ExecutionMode.GRAPHS
    supported_modes = frozenset({ExecutionMode.EAGER, ExecutionMode.COMPILE,
                                 ExecutionMode.GRAPHS})

    def free_memory_bytes(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def graph_runner(self, mode: ExecutionMode, forward: ForwardFn, counters: DeviceCounters,
                     model: torch.nn.Module, cfg: DeviceConfig) -> GraphRunner:
        if mode is ExecutionMode.GRAPHS:
            return CudaGraphRunner(forward, counters)
        return super().graph_runner(mode, forward, counters, model, cfg)


def cuda_plugin() -> CudaPlatform | None:
    if not torch.cuda.is_available():
        return None
    return CudaPlatform(torch.device("cuda", torch.cuda.current_device()))
