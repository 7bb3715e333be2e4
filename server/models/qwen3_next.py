"""Qwen3-Next: a hybrid decoder of Gated DeltaNet (linear attention) layers and gated full
attention layers, every MLP a mixture of experts with a shared expert.

- Linear layers (``config.linear_layers``, three in four in the released models) keep no
  keys or values: a causal depthwise convolution over q/k/v, then the gated delta rule
  (gated_delta.py) over a recurrent state per value head. Both states live in the state
  cache (server/hpu/state_cache.py), one slot per running sequence; ``StateInputs`` gives
  each batch row its slot, how many real tokens it has, and whether it continues a state.
- Full-attention layers use the paged KV cache as Qwen3's do (q/k norms, RoPE over a part
  of each head), with a sigmoid gate on their output: ``q_proj`` yields each head's query
  followed by its gate.
- Norms scale by ``1 + w`` (weights stored centred on zero) in float32; the linear layers'
  output norm is a plain RMSNorm gated by SiLU(z).

Parameter names follow the checkpoint's, with q/k/v and gate/up fused as in llama.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import Rope, TorchLayerOps
from server.hpu.state_cache import LayerState, StateInputs, StateShape
from server.models.config import ModelConfig
from server.models.gated_delta import (
    causal_conv,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from server.models.llama import MLP, LlamaForCausalLM
from server.models.moe import SparseMoeBlock

_TORCH_OPS = TorchLayerOps()


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + w``, in float32, rounded once at the end."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with a residual stream ``(norm(residual + x), residual + x)``."""
        if residual is not None:
            x = residual = residual + x
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return h.to(x.dtype) if residual is None else (h.to(x.dtype), residual)


class GatedRMSNorm(nn.Module):
    """The linear layers' output norm: ``w * rmsnorm(x) * silu(gate)``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention over the paged KV cache with a sigmoid gate on each head's output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # per head: its query, then its gate (the checkpoint's q_proj rows), then k and v
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.ops: TorchLayerOps = _TORCH_OPS

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata
                ) -> torch.Tensor:
        bs, q_len, _ = x.shape
        tokens = bs * q_len
        d = self.head_dim
        query_gate, key, value = self.qkv_proj(x.view(tokens, -1)).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(tokens, self.num_heads, 2 * d)
        gate = query_gate[..., d:].reshape(tokens, self.q_size)
        query = self.q_norm(query_gate[..., :d])
        key = self.k_norm(key.reshape(tokens, self.num_kv_heads, d))
        qkv = torch.cat([query.reshape(tokens, -1), key.reshape(tokens, -1), value], dim=-1)
        query, key, value = self.ops.rotary_write_kv(qkv, rope, kv_cache, meta, self.num_heads,
                                                     self.num_kv_heads)
        if meta.is_prompt:
            out = self.ops.prompt_attention(query, key, value, kv_cache, meta, bs, self.scale)
        else:
            out = self.ops.decode_attention(query, kv_cache, meta, self.scale)
        out = out.reshape(tokens, self.q_size) * torch.sigmoid(gate)
        return self.o_proj(out.view(bs, q_len, self.q_size))


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer; its state lives in the state cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        spec = cfg.linear_attention
        assert spec is not None
        self.num_k_heads = spec.num_key_heads
        self.num_v_heads = spec.num_value_heads
        self.head_k_dim = spec.key_head_dim
        self.head_v_dim = spec.value_head_dim
        self.key_dim = spec.key_dim
        self.value_dim = spec.value_dim
        groups = spec.num_value_heads // spec.num_key_heads
        self.split = spec.split_projections
        if self.split:  # Qwen3.5: q, k, v as the convolution's channels; z, b, a apart
            self.in_proj_qkv = nn.Linear(cfg.hidden_size, spec.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.hidden_size, spec.value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.hidden_size, spec.num_value_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.hidden_size, spec.num_value_heads, bias=False)
        else:
            # per key head: q, k, then its value heads' v and z (the checkpoint's row order)
            self.qkvz_split = [spec.key_head_dim, spec.key_head_dim,
                               groups * spec.value_head_dim, groups * spec.value_head_dim]
            self.in_proj_qkvz = nn.Linear(cfg.hidden_size,
                                          2 * spec.key_dim + 2 * spec.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * spec.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, bias=False,
                                groups=spec.conv_dim)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(spec.num_value_heads))
        self.norm = GatedRMSNorm(spec.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(spec.value_dim, cfg.hidden_size, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x ``[bs, T, H]`` -> (q/k/v as the convolution's channels ``[bs, C, T]``, z, b,
        a), from either checkpoint layout."""
        bs, length, _ = x.shape
        if self.split:
            return (self.in_proj_qkv(x).transpose(1, 2), self.in_proj_z(x),
                    self.in_proj_b(x), self.in_proj_a(x))
        q, k, v, z = self.in_proj_qkvz(x).view(bs, length, self.num_k_heads, -1).split(
            self.qkvz_split, dim=-1)
        b, a = self.in_proj_ba(x).view(bs, length, self.num_k_heads, -1).chunk(2, dim=-1)
        mixed = torch.cat([q.reshape(bs, length, -1), k.reshape(bs, length, -1),
                           v.reshape(bs, length, -1)], dim=-1).transpose(1, 2)
        return mixed, z, b, a

    def state_shape(self, dtype: torch.dtype) -> StateShape:
        """The convolution's inputs in the model dtype; the recurrent state in float32 (it
        accumulates over the whole sequence)."""
        conv_dim, _, kernel = self.conv1d.weight.shape
        return StateShape((conv_dim, kernel - 1), dtype,
                          (self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)

    def forward(self, x: torch.Tensor, cache: LayerState, state: StateInputs) -> torch.Tensor:
        bs, length, _ = x.shape
        conv_cache, recurrent_cache = cache
        mixed, z, b, a = self._project(x)
        # a sequence's first step starts from zeros, whatever its slot held before
        previous = conv_cache.index_select(0, state.slots)
        previous = torch.where(state.has_state.view(-1, 1, 1), previous, 0.0)
        mixed, tail = causal_conv(mixed, previous, self.conv1d.weight.squeeze(1),
                                  state.query_lens)
        conv_cache.index_copy_(0, state.slots, tail.to(conv_cache.dtype))
        q, k, v = mixed.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim],
                                              dim=-1)
        q = q.reshape(bs, length, self.num_k_heads, self.head_k_dim)
        k = k.reshape(bs, length, self.num_k_heads, self.head_k_dim)
        v = v.reshape(bs, length, self.num_v_heads, self.head_v_dim)
        # padding past a row's real tokens neither decays nor writes the state
        real = (torch.arange(length, device=x.device).view(1, -1)
                < state.query_lens.view(-1, 1)).unsqueeze(-1)
        beta = torch.where(real, b.reshape(bs, length, -1).sigmoid(), 0.0)
        g = -self.A_log.float().exp() * F.softplus(a.reshape(bs, length, -1).float()
                                                   + self.dt_bias)
        g = torch.where(real, g, 0.0)
        initial = recurrent_cache.index_select(0, state.slots)
        initial = torch.where(state.has_state.view(-1, 1, 1, 1), initial, 0.0)
        rule = recurrent_gated_delta_rule if length == 1 else chunked_gated_delta_rule
        out, final = rule(q, k, v, g, beta, initial)
        recurrent_cache.index_copy_(0, state.slots, final.to(recurrent_cache.dtype))
        out = self.norm(out, z.reshape(bs, length, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(bs, length, self.value_dim))


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts of moe.py plus one shared expert every token runs, its output
    scaled by a sigmoid gate of the token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.shared_expert = MLP(replace(cfg, mlp_bias=False, mlp_act="silu",
                                         intermediate_size=cfg.shared_expert_intermediate_size))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_linear = index in cfg.linear_layers
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp: nn.Module = (SharedExpertMoeBlock(cfg) if index in cfg.moe_layers
                               else MLP(cfg))
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: the linear or the full attention."""
        return self.linear_attn if self.is_linear else self.self_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor, rope: Rope,
                cache: KVCache | LayerState, meta: AttentionMetadata, state: StateInputs | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form, as llama.py's DecoderLayer."""
        x, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            assert state is not None, "a hybrid model needs its state inputs"
            x = self.linear_attn(x, cache, state)
        else:
            x = self.self_attn(x, rope, cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(nn.Module):
    """Decoder stack plus LM head, with the interface of llama.py's model (the engine calls
    both the same way) and the state cache's tensors as one more input."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary, self.rotary_local = self.build_rotary()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lora_slots = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata,
                lora_slots: torch.Tensor | None = None,
                state_caches: list[LayerState] | None = None,
                state: StateInputs | None = None) -> torch.Tensor:
        """As LlamaForCausalLM's; ``kv_caches`` for the full-attention layers only, in
        order, ``state_caches`` for the linear ones."""
        del lora_slots  # adapters are refused for hybrid models
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions.reshape(-1), x.dtype)
        residual = torch.zeros_like(x)
        kv = iter(kv_caches)
        states = iter(state_caches or ())
        for layer in self.layers:
            cache = next(states) if layer.is_linear else next(kv)
            x, residual = layer(x, residual, rope, cache, meta, state)
        return self.norm(x, residual)[0]

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as weight_load.py reads them: the layout as it is."""
        return tensors

    def state_shapes(self, dtype: torch.dtype) -> list[StateShape]:
        """The state cache's per-slot tensors, one entry per linear layer."""
        return [layer.linear_attn.state_shape(dtype) for layer in self.layers
                if layer.is_linear]

    # the rest of the engine's model interface, as the Llama decoder has it
    build_rotary = LlamaForCausalLM.build_rotary
    use_ops = LlamaForCausalLM.use_ops
    compute_logits = LlamaForCausalLM.compute_logits

    def keep_norms_in_float(self) -> None:
        """Nothing to do: these norms compute 1 + w in float32 themselves."""

    def layer_stack_spec(self) -> None:
        """No one-call decode loop: the linear-attention layers are not the plain layer."""
        return None

    def serve_context(self, max_model_len: int) -> None:
        """No sliding windows to drop."""

    def enable_lora(self, slots: object) -> None:
        raise ValueError("LoRA adapters are not supported for Qwen3-Next (hybrid) models")
