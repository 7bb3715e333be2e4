"""Llama 4 text decoder (``Llama4ForCausalLM``, and the language model of a
``Llama4ForConditionalGeneration`` checkpoint, whose vision tower is
server/models/vision/llama4.py) on the building blocks of llama.py and moe.py.

Its departures from the Llama decoder:

- chunked local attention in the RoPE layers: a token sees the keys of its own chunk of
  ``attention_chunk_size`` positions only (the masks and kernels of server/hpu/attention.py
  and server/hpu/cpu);
- layers without RoPE ("NoPE", every fourth in the released models) attend to the whole
  context; with ``attn_temperature_tuning`` their queries are scaled by
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p``, so that
  attention stays sharp over long contexts;
- the RoPE layers divide each q and k head by its RMS (an "L2 norm" without weight) when
  ``use_qk_norm``. transformers applies it after RoPE; a rotation keeps each rotated pair's
  length, so normalising first is the same and lets the fused rotary kernel write the cache;
- RoPE rotates interleaved pairs ``(x0, x1), (x2, x3)...`` (Meta's complex form). Loading
  reorders the rows of every q and k head into the rotate-half layout ``[x0, x2, ..., x1,
  x3, ...]`` that :func:`server.hpu.layer_ops.apply_rotary` rotates: q and k alike, so their
  dot products and norms are unchanged and the RoPE kernels serve Llama 4 as they are;
- mixture of experts every ``interleave_moe_layer_step``-th layer: the top-k router logits,
  through a sigmoid, scale the chosen experts' *inputs*; a shared expert (an MLP as wide as
  one expert) takes every token. The other layers' dense MLP is ``intermediate_size_mlp``
  wide (ModelConfig's ``intermediate_size``; the experts' width is ``moe_intermediate_size``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import Rope
from server.models.config import ModelConfig
from server.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from server.models.lora import LoRASite
from server.models.moe import DENSE, SparseMoeBlock, dense_experts, expert_plan, grouped_experts
from server.models.rotary import interleaved_to_halves


class Llama4Attention(Attention):
    """Llama attention plus the chunk, the NoPE layers' query temperature and the L2 q/k
    norms; its ``forward`` takes each token's query scale (NoPE layers only use it)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.rotates = index not in cfg.nope_layers
        self.chunk = cfg.layer_chunk(index)
        self.l2_norm = cfg.qk_l2_norm and self.rotates
        self.tuned = cfg.attn_temperature is not None and not self.rotates
        self.eps = cfg.rms_norm_eps

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora_mask: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x ``[bs, q, hidden]`` -> same shape; ``rope``: the identity for NoPE layers;
        ``q_scale`` ``[bs * q, 1, 1]`` float32: the temperature of each token's query."""
        bs, q_len, _ = x.shape
        flat = x.view(bs * q_len, -1)
        qkv = self.qkv_proj(flat)
        if self.lora is not None:
            qkv = self.lora.apply(LoRASite.QKV, flat, qkv, lora_mask)
        if self.l2_norm:
            qkv = self._l2_norm_qk(qkv)
        query, key, value = self.ops.rotary_write_kv(qkv, rope, kv_cache, meta, self.num_heads,
                                                     self.num_kv_heads)
        if self.tuned and q_scale is not None:
            query = (query * q_scale).to(query.dtype)  # in float32, as transformers scales
        if meta.is_prompt:
            out = self.ops.prompt_attention(query, key, value, kv_cache, meta, bs, self.scale,
                                            None, self.window, self.chunk)
        else:
            out = self.ops.decode_attention(query, kv_cache, meta, self.scale, None,
                                            self.window, self.chunk)
        out = out.reshape(bs, q_len, self.q_size)
        if self.lora is None:
            return self.o_proj(out)
        return self.lora.apply(LoRASite.O, out, self.o_proj(out), lora_mask)

    def _l2_norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = (F.rms_norm(t.reshape(-1, self.head_dim).float(), (self.head_dim,),
                           eps=self.eps).to(qkv.dtype).reshape(tokens, -1) for t in (q, k))
        return torch.cat([q, k, v], dim=-1)


class Llama4MoeBlock(SparseMoeBlock):
    """Sigmoid top-k routing that scales the experts' inputs, plus a shared expert:
    ``[..., H] -> [..., H]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.shared_expert = MLP(replace(cfg, intermediate_size=cfg.moe_intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, H]`` -> (sigmoid of the top-k logits ``[T, k]`` in x's dtype, their
        experts ``[T, k]``): no softmax over the experts, no renormalisation."""
        logits, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.sigmoid(logits.float()).to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        plan = expert_plan(x.shape[0], self.top_k, self.num_experts)
        if plan == DENSE:
            out = dense_experts(x, self.w_gate_up, self.w_down, weights, ids, self.ops,
                                scale_inputs=True)
        else:
            out = grouped_experts(x, self.w_gate_up, self.w_down, weights, ids, self.ops, plan,
                                  scale_inputs=True)
        return (self.shared_expert(x) + out).view(shape)


class Llama4DecoderLayer(nn.Module):
    """Pre-norm residual layer (no sandwich norms, no multipliers) of Llama 4."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(cfg, index)
        self.mlp: MLP | Llama4MoeBlock = (Llama4MoeBlock(cfg) if index in cfg.moe_layers
                                          else MLP(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora_mask: torch.Tensor | None = None,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-stream form of llama.py's DecoderLayer."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, lora_mask, q_scale)
        x, residual = self.post_attention_layernorm(x, residual)
        if isinstance(self.mlp, MLP):
            return self.mlp(x, lora_mask), residual
        return self.mlp(x), residual  # experts take no adapters


class Llama4ForCausalLM(LlamaForCausalLM):
    """The Llama decoder stack with Llama 4's layers (parameter names as llama.py's)."""

    layer_class = Llama4DecoderLayer

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
        mm_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As llama.py's: ``mm_embeds`` / ``mm_mask``, the vision tower's rows in place of
        the ``<|patch|>`` tokens' embeddings (server/models/vision/llama4.py); the image
        tokens attend causally and within their chunk, as text does (transformers' masks)."""
        x = self.embed_tokens(input_ids)
        if mm_embeds is not None and mm_mask is not None:
            x = torch.where(mm_mask.view(*x.shape[:2], 1),
                            mm_embeds.view(x.shape).to(x.dtype), x)
        flat_positions = positions.reshape(-1)
        rope = self.rotary(flat_positions, x.dtype)
        # NoPE layers go through the same rotary kernel with cos 1 and sin 0
        no_rope = (torch.ones_like(rope[0]), torch.zeros_like(rope[1]))
        q_scale = None
        if self.config.attn_temperature is not None:
            floor_scale, attn_scale = self.config.attn_temperature
            q_scale = (torch.log1p(torch.floor((flat_positions.float() + 1.0) / floor_scale))
                       * attn_scale + 1.0).view(-1, 1, 1)
        residual = torch.zeros_like(x)
        lora_mask = (self.lora_slots.mask(lora_slots)
                     if self.lora_slots is not None and lora_slots is not None else None)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope if layer.self_attn.rotates else no_rope,
                                kv_cache, meta, lora_mask, q_scale)
        return self.norm(x, residual)[0]

    def serve_context(self, max_model_len: int) -> None:
        """Drops the chunks (and windows) no served sequence can outgrow."""
        super().serve_context(max_model_len)
        for layer in self.layers:
            if layer.self_attn.chunk is not None and layer.self_attn.chunk >= max_model_len:
                layer.self_attn.chunk = None

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Llama 4's checkpoint names and layouts as the loader expects them (weight_load.py):
        ``feed_forward`` -> ``mlp``, the router -> ``gate``, the stacked experts
        (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``) transposed to transformers'
        usual ``[E, 2I, H]`` / ``[E, H, I]``, and q/k rows reordered for rotate-half RoPE
        (a GGUF file's too: llama.cpp keeps Llama 4's interleaved rows, see gguf.py)."""
        for name, tensor in tensors:
            if _STACKED.search(name):  # a GGUF file's (mlp.experts...) are usual already
                tensor = tensor.transpose(1, 2)
            elif self.config.interleaved_rope and _QK.search(name):
                tensor = interleaved_to_halves(tensor, self.config.head_dim)
            yield (name.replace(".feed_forward.", ".mlp.").replace(".mlp.router.", ".mlp.gate."),
                   tensor)


_STACKED = re.compile(r"\.feed_forward\.experts\.(gate_up_proj|down_proj)$")
_QK = re.compile(r"\.self_attn\.(q_proj|k_proj)\.(weight|bias)$")
