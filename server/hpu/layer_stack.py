"""What a model hands a layer-ops backend to run its decoder layers as one call.

A backend that can (the CPU kernels' ``server.hpu.cpu.decode_stack``) turns a
:class:`LayerStackSpec` into a :class:`DecodeStack`: the whole layer loop of a decode step in
one kernel call, the same arithmetic as the model's own loop without the Python
between the kernels. Only the plain decoder layer qualifies, which the model checks before
it builds a spec: pre-norm attention then a gated MLP, with no adapters, per-head norms,
sandwich norms, residual multipliers, sinks or module hooks (tensor parallelism's
all-reduce). Plain data here, so models and backends share it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One plain decoder layer: its two norm weights, its four projections (the modules
    themselves: the backend knows their kinds) and its attention window (None: full)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    window: int | None

    @property
    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj


@dataclass(frozen=True, slots=True)
class LayerStackSpec:
    """The layers in order plus what every layer shares."""

    layers: Sequence[StackLayer]
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    scale: float  # attention's score scale
    softcap: float | None  # attention scores' soft cap (Gemma 2), None: none
    gelu: bool  # GeGLU (Gemma) instead of SwiGLU


class DecodeStack(Protocol):
    """Runs the layers of a decode step, one token a sequence, as one call."""

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step (embeddings ``x`` ``[bs, 1, hidden]``) is one it runs."""
        ...

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, rope: tuple[torch.Tensor,
                 torch.Tensor], kv_caches: list[KVCache], meta: AttentionMetadata
                 ) -> torch.Tensor:
        """The last layer's MLP output; ``residual`` (the stream) is updated in place."""
        ...
