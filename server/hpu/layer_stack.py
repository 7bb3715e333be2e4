"""What a model hands a layer-ops backend to run its decoder layers as one call.

A backend that can (the CPU kernels' ``server.hpu.cpu.decode_stack``) turns a
:class:`LayerStackSpec` into a :class:`DecodeStack`: the whole layer loop of a decode step in
one kernel call, the same arithmetic as the model's own loop without the Python between the
kernels. The layers it describes: pre-norm attention then a gated MLP, optionally with
per-head q/k norms (Qwen3, Gemma 3), norms around each sublayer's output (Gemma 2 / 3's
sandwich) and a second RoPE table for the windowed layers (Gemma 3). The model checks the
rest before it builds a spec: no adapters, residual multipliers, sinks, latent attention,
experts or module hooks (tensor parallelism's all-reduce); hooks added after the spec was
built are not seen by the steps the stack runs. Plain data here, so models and backends
share it without importing each other.
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
    """One decoder layer: its norm weights, its four projections (the modules themselves:
    the backend knows their kinds), its attention window (None: full) and RoPE table.

    ``post_attention_norm`` is the pre-MLP norm (after the residual add) of a plain layer,
    and the norm of the attention output (before it) of a sandwich layer, whose
    ``pre_feedforward_norm`` then comes after the add and ``post_feedforward_norm`` normalises
    the MLP output."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    window: int | None
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # per head, over head_dim (k_norm likewise)
    k_norm: torch.Tensor | None = None
    local_rope: bool = False  # the windowed layers' own RoPE table (Gemma 3)

    @property
    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    @property
    def norms(self) -> tuple[torch.Tensor | None, ...]:
        """Every norm weight, in the kernel's order (absent ones None)."""
        return (self.input_norm, self.post_attention_norm, self.pre_feedforward_norm,
                self.post_feedforward_norm, self.q_norm, self.k_norm)


@dataclass(frozen=True, slots=True)
class LayerStackSpec:
    """The layers in order plus what every layer shares."""

    layers: Sequence[StackLayer]
    dtype: torch.dtype  # the activations' (norm weights may be float32: Gemma's 1 + w)
    num_heads: int
    num_kv_heads: int
    head_dim: int
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
                 torch.Tensor], local_rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """The last layer's MLP output; ``residual`` (the stream) is updated in place;
        ``local_rope``: the windowed layers' table (``rope`` again where there is none)."""
        ...
