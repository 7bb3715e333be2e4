"""DeepSeek-V2 / V3's multi-head latent attention (MLA) over a paged cache of latents.

Each token projects the hidden state to one latent ``c`` of ``kv_lora_rank`` (``r``) values
and one RoPE key ``k_pe`` of ``qk_rope_head_dim`` (``dr``) shared by every head; head ``h``'s
no-RoPE key and its value are ``W_UK[h] c`` and ``W_UV[h] c`` (``kv_b_proj``, ``dn`` and
``dv`` rows per head). The cache keeps ``[c, k_pe]`` (``r + dr`` values per token and
layer: one "head" in :class:`~server.hpu.kv_cache.KVCacheLayout`, keys and values at once)
instead of every head's K and V. Two ways to attend over it:

- expanded (naive): turn the latents into per-head keys ``[W_UK c, k_pe]`` and values
  ``W_UV c``, then ordinary attention. What a fresh prompt does: its keys are computed once
  and each is used by every query of the prompt.
- absorbed: ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so each query is moved into the
  latent space once (``[W_UK^T q_nope, q_pe]``, ``r + dr`` values per head) and scores the
  cached latents directly, multi-query style (every head reads the one cached "head");
  the weighted sum of latents goes through ``W_UV`` after. Nothing of the context is
  expanded, so decode (and a prompt chunk after a cached context) reads ``r + dr`` values
  per cached token instead of computing ``H * (dn + dv)``.

The absorbed paths reuse the flat paged attention of server/hpu/attention.py with the latent
cache as both keys and values (the output's last ``dr`` columns are dropped); the expanded
decode is kept beside it (``absorbed_decode = False``) as the reference and for the
benchmark (benchmarks/mla_decode.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from server.hpu.attention import (
    AttentionMetadata,
    flat_paged_attention,
    paged_prefill_attention,
    prompt_attention,
)
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import Rope, TorchLayerOps, apply_rotary
from server.models.config import ModelConfig
from server.models.deepseek_config import MLASettings
from server.models.norm import RMSNorm

_TORCH_OPS = TorchLayerOps()


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: the latent to each head's no-RoPE key and value, ``weight [H * (dn +
    dv), r]``. A bare parameter rather than an ``nn.Linear``: the absorbed path reads its
    per-head blocks, which a platform's packed linear would hide."""

    def __init__(self, heads: int, out_per_head: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads * out_per_head, rank))


class MLAttention(nn.Module):
    """Drop-in for the Llama ``Attention``: ``[bs, q, hidden] -> [bs, q, hidden]``."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        assert cfg.mla is not None
        mla = cfg.mla
        self.mla = mla
        self.num_heads = cfg.num_heads  # this rank's, under tensor parallelism
        self.scale = mla.softmax_scale
        hidden, heads = cfg.hidden_size, cfg.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=cfg.o_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.cache_dim, bias=cfg.o_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = LatentUpProjection(heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                            mla.kv_lora_rank)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=cfg.o_bias)
        self.window = None  # no sliding windows in this family
        self.ops: TorchLayerOps = _TORCH_OPS
        self.lora = None  # adapters are refused for this attention (see enable_lora)
        # decode by absorbing W_UK / W_UV into the query and output (the served path), or
        # by expanding every cached latent (the reference; benchmarks/mla_decode.py)
        self.absorbed_decode = True

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata,
                lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        del lora_mask
        mla = self.mla
        bs, q_len, _ = x.shape
        flat = x.view(bs * q_len, -1)
        tokens, heads = flat.shape[0], self.num_heads
        if mla.q_lora_rank is None:
            q = self.q_proj(flat)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(flat)))
        q_nope, q_pe = q.view(tokens, heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(flat).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # the queries' RoPE parts and the shared key's rotate as one tensor
        pe = apply_rotary(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), *rope)
        q_pe, k_pe = pe[:, :heads], pe[:, heads:]
        entry = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + dr]
        cache = kv_cache[0]
        cache[meta.slot_block, :, meta.slot_offset] = entry.to(cache.dtype)
        if meta.is_prompt and meta.context_lens is None:
            out = self._expanded_prompt(q_nope, q_pe, latent, k_pe, bs)
        elif meta.is_prompt:
            q_abs = self._absorb(q_nope, q_pe).view(bs, q_len, heads, -1)
            out = self._values(paged_prefill_attention(q_abs, cache, cache, meta, self.scale)
                               .reshape(tokens, heads, -1))
        elif self.absorbed_decode:
            out = self._values(self.ops.decode_attention(self._absorb(q_nope, q_pe),
                                                         kv_cache, meta, self.scale))
        else:
            out = self._expanded_decode(torch.cat([q_nope, q_pe], dim=-1), cache, meta)
        return self.o_proj(out.reshape(bs, q_len, heads * mla.v_head_dim))

    def _up_weight(self) -> torch.Tensor:
        """``kv_b_proj`` per head: ``[H, dn + dv, r]`` (W_UK rows, then W_UV rows)."""
        return self.kv_b_proj.weight.view(self.num_heads, -1, self.mla.kv_lora_rank)

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Queries in the latent space: ``[W_UK[h]^T q_nope, q_pe]``, ``[T, H, r + dr]``."""
        w_uk = self._up_weight()[:, : self.mla.qk_nope_head_dim]  # [H, dn, r]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        return torch.cat([q_latent, q_pe], dim=-1)

    def _values(self, attended: torch.Tensor) -> torch.Tensor:
        """Attention over the cached ``[c, k_pe]`` ``[T, H, r + dr]`` -> each head's value
        ``W_UV[h] (sum of p c)`` ``[T, H, dv]`` (the RoPE columns are dropped)."""
        w_uv = self._up_weight()[:, self.mla.qk_nope_head_dim:]  # [H, dv, r]
        latent = attended[..., : self.mla.kv_lora_rank].transpose(0, 1)  # [H, T, r]
        return torch.bmm(latent, w_uv.transpose(1, 2)).transpose(0, 1)

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents ``[..., r]`` and RoPE keys ``[..., 1, dr]`` -> per-head keys ``[..., H,
        dn + dr]`` and values ``[..., H, dv]``."""
        mla = self.mla
        kv = F.linear(latent, self.kv_b_proj.weight)
        kv = kv.view(*latent.shape[:-1], self.num_heads, -1)
        k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(*k_nope.shape[:-1], -1)], dim=-1)
        return key, value

    def _expanded_prompt(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                         k_pe: torch.Tensor, bs: int) -> torch.Tensor:
        """A fresh prompt (no cached context): its own keys and values, expanded."""
        key, value = self._expand(latent, k_pe)
        tokens, heads = key.shape[:2]
        q_len = tokens // bs
        query = torch.cat([q_nope, q_pe], dim=-1)
        out = prompt_attention(query.view(bs, q_len, heads, -1), key.view(bs, q_len, heads, -1),
                               value.view(bs, q_len, heads, -1), self.scale)
        return out.reshape(tokens, heads, -1)

    def _expanded_decode(self, query: torch.Tensor, cache: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """The reference decode: every cached latent of the batch expanded to per-head keys
        and values, then flat paged attention over those blocks."""
        assert meta.block_list is not None
        mla = self.mla
        blocks = cache.flatten(1).index_select(0, meta.block_list).view(
            -1, meta.block_size, mla.cache_dim).to(query.dtype)  # [N, B, r + dr]
        latent, k_pe = blocks.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        key, value = self._expand(latent, k_pe.unsqueeze(2))  # [N, B, H, .]
        gathered = dataclasses.replace(meta, block_list=torch.arange(
            key.shape[0], device=key.device))
        return flat_paged_attention(query, key.transpose(1, 2).contiguous(),
                                    value.transpose(1, 2).contiguous(), gathered, self.scale)


def deinterleave_rope_rows(name: str, tensor: torch.Tensor, mla: MLASettings) -> torch.Tensor:
    """A checkpoint tensor with the RoPE rows of its queries (each head's last ``dr`` rows of
    ``q_proj`` / ``q_b_proj``) or of its shared key (the last ``dr`` rows of
    ``kv_a_proj_with_mqa``) reordered from interleaved pairs ``(x0, x1), (x2, x3)...`` to
    halves ``(x0, x2, ...), (x1, x3, ...)``: rotate-half RoPE on those rows then gives the
    same scores as the checkpoint's pairwise rotation (queries and keys move alike).
    Other tensors are returned as they are."""
    dr = mla.qk_rope_head_dim
    order = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        heads = tensor.reshape(-1, mla.qk_head_dim, *tensor.shape[1:])
        nope, pe = heads.split([mla.qk_nope_head_dim, dr], dim=1)
        return torch.cat([nope, pe.index_select(1, order)], dim=1).reshape(tensor.shape)
    if name.endswith((".kv_a_proj_with_mqa.weight", ".kv_a_proj_with_mqa.bias")):
        latent, pe = tensor.split([mla.kv_lora_rank, dr], dim=0)
        return torch.cat([latent, pe.index_select(0, order)], dim=0)
    return tensor
