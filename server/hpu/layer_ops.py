"""The few fusable operations of a decoder layer, behind one interface.

:class:`TorchLayerOps` is plain PyTorch with static shapes: every device, compiled graphs,
the reference numerics. A platform may bring its own subclass (the CPU backend's fused
kernels, ``server.hpu.cpu.layer_ops``); the model calls whichever it was given.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from server.hpu.attention import (
    AttentionMetadata,
    flat_paged_attention,
    flat_paged_verify_attention,
    paged_prefill_attention,
    prompt_attention,
    write_kv,
)
from server.hpu.kv_cache import KVCache
from server.hpu.layer_stack import DecodeStack, LayerStackSpec
from server.hpu.types import DecodeLayout

# cos, sin [T, 1, R] in the model dtype; R == D, or R < D for partial rotary embeddings
Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``[T, H, D]``; queries and keys go through in one call. Tables
    narrower than D rotate the first R dims only, the rest pass through (Phi-4-mini's
    partial_rotary_factor)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]),
                         dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """Reference backend: PyTorch expressions only."""

    name = "torch"
    # Decode metadata this backend reads: the flat block list of vLLM's Gaudi backend.
    decode_layout: ClassVar[DecodeLayout] = DecodeLayout.FLAT
    # whether torch.ops.hpu_serve.lora_add_ serves LoRA deltas (server/models/lora)
    lora_kernel: ClassVar[bool] = False

    def kv_cache_views(self, kv_caches: list[KVCache]) -> list[KVCache]:
        """The engine's caches (``[blocks, Hkv, B, D]`` each) as this backend lays them out."""
        return kv_caches

    def decode_stack(self, spec: LayerStackSpec) -> DecodeStack | None:
        """The decoder layers of a decode step as one call, where this backend has one
        for ``spec``'s layers (see layer_stack.py); None: the model runs its layer loop."""
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, whatever the weight dtype.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        if weight.dtype != x.dtype:  # a float32 weight (Gemma's 1 + w): scale, then round
            return (h * weight).to(x.dtype)
        return weight * h.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): a sublayer's residual add and the next
        norm."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): tanh-approximated GELU of the gate times the up projection."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_write_kv(self, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache,
                        meta: AttentionMetadata, num_heads: int, num_kv_heads: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv ``[T, (Hq + 2 Hkv) * D]`` -> rotated q ``[T, Hq, D]``, rotated k and v
        ``[T, Hkv, D]``; k and v are written to their cache slots."""
        tokens = qkv.shape[0]
        heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, -1)
        # Queries and keys are rotated as one tensor: half the elementwise ops per layer.
        qk = apply_rotary(heads[:, : num_heads + num_kv_heads], *rope)
        query, key = qk[:, :num_heads], qk[:, num_heads:]
        value = heads[:, num_heads + num_kv_heads :]
        write_kv(kv_cache[0], kv_cache[1], key, value, meta)
        return query, key, value

    def prompt_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: KVCache, meta: AttentionMetadata, bs: int, scale: float,
                         softcap: float | None = None, window: int | None = None,
                         chunk: int | None = None, sinks: torch.Tensor | None = None
                         ) -> torch.Tensor:
        """Causal attention of a right-padded prefill batch: q ``[bs * q, Hq, D]``, k / v
        ``[bs * q, Hkv, D]`` -> ``[bs * q, Hq, D]``; ``softcap``: Gemma 2's score cap;
        ``window``: the layer's sliding window (None: global attention); ``chunk``: the
        layer's attention chunk (Llama 4; None: not chunked); ``sinks``: gpt-oss's per-head
        sink logits ``[Hq]`` (None: none). ``meta.image_ends`` (Gemma 3): image tokens
        see their image's later tokens too."""
        return self.masked_prompt_attention(query, key, value, kv_cache[0], kv_cache[1], meta,
                                            bs, scale, softcap, window, chunk, sinks)

    @staticmethod
    def masked_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: AttentionMetadata, bs: int, scale: float,
                                softcap: float | None, window: int | None, chunk: int | None,
                                sinks: torch.Tensor | None) -> torch.Tensor:
        """The PyTorch prefill paths, keys read from ``k_cache`` ``[blocks, Hkv, B, D]``
        (a view of it, where a backend stores them otherwise) after a cached context."""
        tokens, heads, dim = query.shape
        q_len = tokens // bs
        ends = meta.image_ends
        if meta.context_lens is not None:  # after a context in the cache: read it there
            out = paged_prefill_attention(query.view(bs, q_len, heads, dim), k_cache, v_cache,
                                          meta, scale, softcap, window, chunk, sinks=sinks,
                                          image_ends=ends)
            return out.reshape(tokens, heads, dim)
        # no context beyond the prompt itself: the fresh k / v suffice
        out = prompt_attention(query.view(bs, q_len, heads, dim),
                               key.view(bs, q_len, key.shape[1], dim),
                               value.view(bs, q_len, value.shape[1], dim), scale, softcap,
                               window, chunk, sinks=sinks, image_ends=ends)
        return out.reshape(tokens, heads, dim)

    def decode_attention(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                         scale: float, softcap: float | None = None, window: int | None = None,
                         chunk: int | None = None, sinks: torch.Tensor | None = None
                         ) -> torch.Tensor:
        if meta.block_bias is not None and meta.block_bias.dim() == 3:  # a verify step
            return flat_paged_verify_attention(query, kv_cache[0], kv_cache[1], meta, scale,
                                               softcap, window, chunk, sinks=sinks)
        return flat_paged_attention(query, kv_cache[0], kv_cache[1], meta, scale, softcap,
                                    window, chunk, sinks=sinks)

    def can_serve(self, kv_dtype: torch.dtype, attn_softcap: float | None,
                  window: int | None = None, partial_rotary: bool = False) -> bool:
        """Whether these ops' attention reads a KV cache stored in ``kv_dtype``, caps
        scores where the model asks, masks by a sliding ``window`` shorter than the served
        context, and rotates part of each head only (these do all four)."""
        return True

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy token per row of ``[B, V]`` logits (the first index on ties)."""
        return logits.argmax(dim=-1)
