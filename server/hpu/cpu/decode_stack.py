"""A decode step's decoder layers as one call: ``torch.ops.hpu_serve.decode_layers``.

The kernel (csrc/decode_stack.cpp) makes the calls the model's layer loop makes through
:class:`~server.hpu.cpu.layer_ops.FusedCpuLayerOps`, in the same order, so the step's
results are the same bits; it saves the Python between the kernels, ~2.5 ms a step for
SmolLM2's 30 layers (its batch-1 step: 8.2 -> 6.0 ms). Each projection runs what its module
would: int4 codes (:class:`SmallBatchInt4Linear`, up to its ``max_rows``), then the bf16
copy (:class:`PackedLinear`, up to its ``small_rows``), oneDNN's packed weight past them.
Prefill and speculative verify steps (several tokens a sequence) take the model's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.linear import PackedLinear, SmallBatchInt4Linear
from server.hpu.kv_cache import KVCache
from server.hpu.layer_stack import LayerStackSpec


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection as the kernel takes it: its int4 blocks (with the bias added after
    them) up to ``int4_rows`` rows, then its bf16 copy (with its fp32 bias inside) up to
    ``bf16_rows``, then its oneDNN module."""

    int4: torch.Tensor | None
    int4_bias: torch.Tensor | None
    int4_rows: int
    bf16: torch.Tensor | None
    bf16_bias: torch.Tensor | None
    bf16_rows: int
    out_features: int
    group_size: int
    dense: PackedLinear

    @property
    def small_rows(self) -> int:
        """Up to this many rows the projection does not need its oneDNN weight."""
        return max(self.int4_rows, self.bf16_rows)

    @classmethod
    def of(cls, linear: nn.Module) -> Projection | None:
        """None where the module is not one the kernel reproduces (aten's int4 kernel, an
        unpacked or activated linear, hooks such as a rank's all-reduce)."""
        if linear._forward_hooks or linear._forward_pre_hooks:
            return None
        int4, int4_bias, int4_rows, group_size = None, None, 0, 0
        if isinstance(linear, SmallBatchInt4Linear):
            if linear.packed is None:
                return None
            int4, int4_bias, int4_rows = linear.packed.weight, linear.bias, linear.max_rows
            group_size = linear.packed.group_size
            linear = linear.dense
        if not cls._plain(linear):
            return None
        assert isinstance(linear, PackedLinear)
        small = linear.small
        if small is None:
            return cls(int4, int4_bias, int4_rows, None, None, 0, linear.out_features,
                       group_size, linear)
        return cls(int4, int4_bias, int4_rows, small.weight, small.bias, linear.small_rows,
                   linear.out_features, group_size, linear)

    @staticmethod
    def _plain(linear: nn.Module) -> bool:
        return (type(linear) is PackedLinear and linear.activation == "none"
                and not linear._forward_hooks and not linear._forward_pre_hooks)


class FusedDecodeStack:
    """The layers' tensors gathered once, in the kernel's argument order. oneDNN's packed
    weights are read from their modules when a step needs them: sleep mode replaces those
    opaque tensors, where it frees and refills every other one in place."""

    def __init__(self, spec: LayerStackSpec, projections: list[Projection],
                 dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.eps = spec.rms_norm_eps
        self.scale = spec.scale
        self.softcap = spec.softcap or 0.0
        self.gelu = spec.gelu
        self.head_dim = spec.head_dim
        self.norms = [w for layer in spec.layers for w in layer.norms]
        # per layer: its window (0: none) and whether it rotates by the local RoPE table
        self.layer_params = [n for layer in spec.layers
                             for n in (layer.window or 0, int(layer.local_rope))]
        self.int4 = [p.int4 for p in projections]
        self.int4_biases = [p.int4_bias for p in projections]
        self.bf16 = [p.bf16 for p in projections]
        self.bf16_biases = [p.bf16_bias for p in projections]
        self.params = [n for p in projections
                       for n in (p.out_features, p.group_size, p.int4_rows, p.bf16_rows)]
        self.dense = [p.dense for p in projections]
        # up to this many rows no projection needs its oneDNN weight
        self.small_rows = min(p.small_rows for p in projections)

    @classmethod
    def build(cls, spec: LayerStackSpec) -> FusedDecodeStack | None:
        """The stack, or None where a projection or norm is not one the kernel takes."""
        if not spec.layers or not hasattr(torch.ops.hpu_serve, "decode_layers"):
            return None
        dtype = spec.dtype
        if dtype not in (torch.float32, torch.bfloat16):  # the fused kernels' dtypes
            return None
        projections = []
        for layer in spec.layers:
            # the fused norm's weights: the activations' dtype or float32 (Gemma's 1 + w)
            if {w.dtype for w in layer.norms if w is not None} - {dtype, torch.float32}:
                return None
            for linear in layer.projections:
                projection = Projection.of(linear)
                if projection is None:
                    return None
                projections.append(projection)
        return cls(spec, projections, dtype)

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (not meta.is_prompt and x.dim() == 3 and x.shape[1] == 1
                and x.dtype == self.dtype and meta.block_tables is not None
                and meta.seq_lens is not None)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 local_rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        rows = x.shape[0]
        cos, sin = rope
        local_cos, local_sin = local_rope
        dense: list[torch.Tensor] = []
        dense_biases: list[torch.Tensor | None] = []
        if rows > self.small_rows:
            dense = [m.packed_weight for m in self.dense]
            dense_biases = [m.bias for m in self.dense]
        return torch.ops.hpu_serve.decode_layers(
            x, residual, [cos.view(rows, -1), sin.view(rows, -1), local_cos.view(rows, -1),
                          local_sin.view(rows, -1)],
            [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
            meta.block_tables, meta.seq_lens, self.norms, self.int4, self.int4_biases,
            self.bf16, self.bf16_biases, dense, dense_biases, self.params, self.layer_params,
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale,
            self.softcap, self.gelu)
