"""A small decode step's decoder layers as one call: ``torch.ops.hpu_serve.decode_layers``.

The kernel (csrc/decode_stack.cpp) makes the calls the model's layer loop makes through
:class:`~server.hpu.cpu.layer_ops.FusedCpuLayerOps`, in the same order, so the step's
results are the same bits; it saves the Python between the kernels, ~3 ms of SmolLM2's ~9.5
ms batch-1 step. It serves batches that every projection runs on our small-batch kernels:
int4 codes (:class:`SmallBatchInt4Linear` up to its ``max_rows``) or the bf16 copy
(:class:`PackedLinear` up to its ``small_rows``); a bigger batch, a prefill or a speculative
verify step takes the model's loop.
"""

from __future__ import annotations

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.linear import PackedLinear, SmallBatchInt4Linear
from server.hpu.kv_cache import KVCache
from server.hpu.layer_stack import LayerStackSpec


def _small_batch_weights(linear: nn.Module
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                    torch.Tensor | None, int, int, int] | None:
    """(int4 blocks, bf16 copy, bias, output features, int4 group, max rows) of a projection
    our small-batch kernels serve, or None."""
    if linear._forward_hooks or linear._forward_pre_hooks:  # e.g. a rank's all-reduce
        return None
    if isinstance(linear, SmallBatchInt4Linear) and linear.packed is not None:
        packed = linear.packed
        return (packed.weight, None, linear.bias, packed.out_features, packed.group_size,
                linear.max_rows)
    if type(linear) is PackedLinear and linear.small is not None:
        small = linear.small
        return None, small.weight, small.bias, small.out_features, 0, linear.small_rows
    return None


class FusedDecodeStack:
    """The layers' tensors gathered once, in the kernel's argument order (the tensors
    themselves: sleep mode frees and refills their storage in place, which they follow)."""

    def __init__(self, spec: LayerStackSpec, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.eps = spec.rms_norm_eps
        self.scale = spec.scale
        self.softcap = spec.softcap or 0.0
        self.gelu = spec.gelu
        self.norms: list[torch.Tensor] = []
        self.int4: list[torch.Tensor | None] = []
        self.bf16: list[torch.Tensor | None] = []
        self.biases: list[torch.Tensor | None] = []
        self.params: list[int] = []
        self.windows = [layer.window or 0 for layer in spec.layers]
        rows = []
        for layer in spec.layers:
            self.norms += [layer.input_norm, layer.post_attention_norm]
            for linear in layer.projections:
                weights = _small_batch_weights(linear)
                assert weights is not None  # build() checked
                int4, bf16, bias, out_features, group, max_rows = weights
                self.int4.append(int4)
                self.bf16.append(bf16)
                self.biases.append(bias)
                self.params += [out_features, group]
                rows.append(max_rows)
        self.max_rows = min(rows)

    @classmethod
    def build(cls, spec: LayerStackSpec) -> FusedDecodeStack | None:
        """The stack, or None where a layer has a projection or norm the kernel does not take
        (oneDNN-only weights, hooks, a norm weight of another dtype)."""
        if not spec.layers or not hasattr(torch.ops.hpu_serve, "decode_layers"):
            return None
        dtype = spec.layers[0].input_norm.dtype
        for layer in spec.layers:
            if any(_small_batch_weights(p) is None for p in layer.projections):
                return None
            # the fused norm's weights: the activations' dtype or float32 (Gemma's 1 + w)
            if {layer.input_norm.dtype, layer.post_attention_norm.dtype} - {dtype, torch.float32}:
                return None
        if dtype != torch.bfloat16:  # the small-batch kernels' activations
            return None
        return cls(spec, dtype)

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (not meta.is_prompt and x.dim() == 3 and x.shape[1] == 1
                and x.shape[0] <= self.max_rows and x.dtype == self.dtype
                and meta.block_tables is not None and meta.seq_lens is not None)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        rows = x.shape[0]
        cos, sin = rope
        return torch.ops.hpu_serve.decode_layers(
            x, residual, cos.view(rows, -1), sin.view(rows, -1), [k for k, _ in kv_caches],
            [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.seq_lens,
            self.norms, self.int4, self.bf16, self.biases, self.params, self.windows,
            self.num_heads, self.num_kv_heads, self.eps, self.scale, self.softcap, self.gelu)
