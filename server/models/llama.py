"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2, Granite, Phi-3,
Gemma 2/3; Mixtral, Qwen3-MoE and gpt-oss with the experts of moe.py) over a paged KV cache;
server/models/registry.py lists the families and what each changes."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from server.hpu.attention import AttentionMetadata
from server.hpu.kv_cache import KVCache
from server.hpu.layer_ops import Rope, TorchLayerOps
from server.hpu.layer_stack import DecodeStack, LayerStackSpec, StackLayer
from server.models.config import ModelConfig
from server.models.lora import LayerLoRA, LoRASite, LoRASlots
from server.models.mla import MLAttention
from server.models.moe import SparseMoeBlock
from server.models.norm import RMSNorm
from server.models.rotary import MRotaryEmbedding, RotaryEmbedding

_TORCH_OPS = TorchLayerOps()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_multiplier or cfg.head_dim**-0.5
        # q, k and v as one matmul: fewer, larger GEMMs are faster on every device.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.softcap = cfg.attn_softcap  # Gemma 2
        self.window = cfg.layer_window(index)  # sliding-window layers (Mistral, Gemma 2/3)
        # gpt-oss: a learned logit per query head in every softmax's denominator
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attn_sinks else None
        self.ops: TorchLayerOps = _TORCH_OPS
        self.lora: LayerLoRA | None = None  # --enable-lora: the layer's adapter slots

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x ``[bs, q, hidden]`` (q == 1 for decode) -> same shape; ``lora_mask``: each
        token row's adapter slot, one-hot (see server/models/lora)."""
        bs, q_len, _ = x.shape
        flat = x.view(bs * q_len, -1)
        qkv = self.qkv_proj(flat)
        if self.lora is not None:
            qkv = self.lora.apply(LoRASite.QKV, flat, qkv, lora_mask)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        query, key, value = self.ops.rotary_write_kv(qkv, rope, kv_cache, meta, self.num_heads,
                                                     self.num_kv_heads)
        if meta.is_prompt:
            out = self.ops.prompt_attention(query, key, value, kv_cache, meta, bs, self.scale,
                                            self.softcap, self.window, sinks=self.sinks)
        else:
            out = self.ops.decode_attention(query, kv_cache, meta, self.scale, self.softcap,
                                            self.window, sinks=self.sinks)
        out = out.reshape(bs, q_len, self.q_size)
        if self.lora is None:
            return self.o_proj(out)
        return self.lora.apply(LoRASite.O, out, self.o_proj(out), lora_mask)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's (and Gemma 3's) per-head RMSNorm of q and k (v untouched), ahead of
        RoPE."""
        assert self.q_norm is not None and self.k_norm is not None
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim))  # one row per (token, head)
        k = self.k_norm(k.reshape(-1, self.head_dim))
        return torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """``intermediate_size``: other than the config's (DeepSeek's shared experts)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.mlp_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU
        self.ops: TorchLayerOps = _TORCH_OPS
        self.lora: LayerLoRA | None = None  # --enable-lora: the layer's adapter slots

    def forward(self, x: torch.Tensor, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora.apply(LoRASite.GATE_UP, x, gate_up, lora_mask)
        act = self.ops.gelu_tanh_and_mul(gate_up) if self.gelu else \
            self.ops.silu_and_mul(gate_up)
        if self.lora is None:
            return self.down_proj(act)
        return self.lora.apply(LoRASite.DOWN, act, self.down_proj(act), lora_mask)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        # DeepSeek's latent attention, or the usual heads
        self.self_attn: Attention | MLAttention = (
            MLAttention(cfg, index) if cfg.mla is not None else Attention(cfg, index))
        # Gemma 3's sliding layers rotate by their own RoPE table
        self.local_rope = cfg.uses_local_rope and self.self_attn.window is not None
        # mixture-of-experts families list their sparse layers; the rest stay dense
        self.mlp: MLP | SparseMoeBlock = MLP(cfg)
        if index in cfg.moe_layers:
            shared = (MLP(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size)
                      if cfg.num_shared_experts else None)
            self.mlp = SparseMoeBlock(cfg, shared)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier
        # Gemma 2 norms each sublayer's output too (its post_attention_layernorm is that
        # norm; the pre-MLP one is pre_feedforward_layernorm)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: ``x`` is the previous layer's MLP output (the embeddings, on
        a zero stream, for the first layer); returns this layer's MLP output and the stream.
        Each residual add is fused with the norm that follows it, and every layer runs the
        same code (one compiled graph serves them all)."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, lora_mask)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x),
                                                         residual)
            return self.post_feedforward_layernorm(self._mlp(x, lora_mask)), residual
        if self.residual_multiplier != 1.0:  # Granite
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self._mlp(x, lora_mask)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual

    def stack_layer(self) -> StackLayer | None:
        """This layer as a backend's one-call decode loop takes it (layer_stack.py): pre-norm
        attention then a gated MLP, with q/k norms, sandwich norms and a local RoPE table
        where the family has them; None where it has anything else (adapters, sinks, latent
        attention, experts, a residual multiplier, hooks)."""
        attn, mlp = self.self_attn, self.mlp
        if type(attn) is not Attention or type(mlp) is not MLP:
            return None
        norms = [self.input_layernorm, self.post_attention_layernorm]
        if self.sandwich:
            norms += [self.pre_feedforward_layernorm, self.post_feedforward_layernorm]
        if attn.q_norm is not None and attn.k_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        modules = (self, attn, mlp, *norms)
        if (attn.lora is not None or mlp.lora is not None or attn.sinks is not None
                or self.residual_multiplier != 1.0
                or any(type(n) is not RMSNorm or n.eps != self.input_layernorm.eps
                       for n in norms)
                or any(m._forward_hooks or m._forward_pre_hooks for m in modules)):
            return None
        sandwich = ((self.pre_feedforward_layernorm.weight,
                     self.post_feedforward_layernorm.weight) if self.sandwich else (None, None))
        qk = ((attn.q_norm.weight, attn.k_norm.weight)
              if attn.q_norm is not None and attn.k_norm is not None else (None, None))
        return StackLayer(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                          attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj,
                          attn.window, *sandwich, *qk, self.local_rope)

    def _mlp(self, x: torch.Tensor, lora_mask: torch.Tensor | None) -> torch.Tensor:
        if isinstance(self.mlp, MLP):
            return self.mlp(x, lora_mask)
        return self.mlp(x)  # experts take no adapters


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head. Parameter names follow Hugging Face's, except that
    q/k/v and gate/up are fused (the loader concatenates them) and experts are stacked
    (``mlp.w_gate_up`` / ``mlp.w_down``, see moe.py)."""

    # a family's subclass may bring its own layer (llama4.py), built as ``(cfg, index)``
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary, self.rotary_local = self.build_rotary()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lora_slots: LoRASlots | None = None
        # EAGLE-3: the layers whose incoming residual stream forward() appends to its output
        self.aux_layers: tuple[int, ...] = ()
        # a backend's one-call layer loop for decode steps (see use_ops)
        self.decode_stack: DecodeStack | None = None

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
        """input_ids/positions ``[bs, q]`` (M-RoPE: positions ``[3, bs, q]``) -> final
        hidden states ``[bs, q, hidden]`` (then, with :meth:`emit_aux_hidden`, the stream
        entering each of those layers);
        ``lora_slots``: each token's adapter slot (0: none), with :meth:`enable_lora`;
        ``mm_embeds`` ``[bs * q, hidden]``: rows that replace the embeddings of the tokens
        ``mm_mask`` ``[bs * q, 1]`` marks (a vision-language prompt's image tokens)."""
        x = self.embed_tokens(input_ids)
        cfg = self.config
        if cfg.embedding_multiplier != 1.0:  # Granite, Gemma
            if cfg.embedding_multiplier_in_dtype:
                x = x * torch.tensor(cfg.embedding_multiplier, dtype=x.dtype)
            else:
                x = x * cfg.embedding_multiplier
        if mm_embeds is not None and mm_mask is not None:
            # a select, not a scatter: the same graph whatever the number of image tokens
            x = torch.where(mm_mask.view(*x.shape[:2], 1),
                            mm_embeds.view(x.shape).to(x.dtype), x)
        rope = self.rotary(positions, x.dtype)
        local_rope = (self.rotary_local(positions, x.dtype)
                      if self.rotary_local is not None else rope)
        residual = torch.zeros_like(x)  # 0 + x is exact: the first add changes nothing
        lora_mask = (self.lora_slots.mask(lora_slots)
                     if self.lora_slots is not None and lora_slots is not None else None)
        aux = []
        stack = self.decode_stack
        if (stack is not None and lora_mask is None and not self.aux_layers
                and stack.serves(x, meta)):
            x = stack(x, residual, rope, local_rope, kv_caches, meta)  # the loop below
        else:
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                if index in self.aux_layers:
                    aux.append(x + residual)
                x, residual = layer(x, residual, local_rope if layer.local_rope else rope,
                                    kv_cache, meta, lora_mask)
        out = self.norm(x, residual)[0]
        return torch.cat([out, *aux], dim=-1) if aux else out

    def build_rotary(self, device: torch.device | None = None
                     ) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        """The RoPE tables (float32 buffers, computed here: the loader calls this again on
        the real device after building the model on the meta device): the global one, and
        Gemma 3's sliding layers' own."""
        cfg = self.config
        dim = cfg.rotary_dim or cfg.head_dim
        rotary = (MRotaryEmbedding(dim, cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling, cfg.mrope_section)
                  if cfg.mrope_section else
                  RotaryEmbedding(dim, cfg.max_position_embeddings, cfg.rope_theta,
                                  cfg.rope_scaling)).to(device)
        local = None
        if cfg.local_rope_theta is not None:
            local = RotaryEmbedding(dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                    cfg.local_rope_scaling).to(device)
        return rotary, local

    def checkpoint_tensors(self, tensors: Iterator[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors named and laid out as weight_load.py expects them: the
        Llama layout as it is (a family's subclass may rename or reorder)."""
        return tensors

    def keep_norms_in_float(self) -> None:
        """Gemma's norms scale by 1 + w in float32 and round after, as its reference does:
        1 + w stored in bfloat16 would lose w's low bits (1.01 becomes 1.0078)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.float()

    def keep_router_bias_in_float(self) -> None:
        """DeepSeek-V3's expert-choice bias stays float32, as its reference keeps it: in
        bfloat16 its small differences between experts would round away and change picks."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock) and module.e_score_correction_bias is not None:
                module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()

    def serve_context(self, max_model_len: int) -> None:
        """Drops the windows no served sequence can outgrow: they would mask nothing, and
        their layers then skip the masks (Gemma 3's sliding layers keep their own RoPE)."""
        for layer in self.layers:
            if layer.self_attn.window is not None and layer.self_attn.window >= max_model_len:
                layer.self_attn.window = None

    def enable_lora(self, slots: LoRASlots) -> None:
        """Gives every layer's projections its adapter slots (``--enable-lora``): from then
        on each forward adds each token's adapter, the slot index tensor an input."""
        if self.config.mla is not None:
            raise ValueError("LoRA adapters (--enable-lora) are not supported for models "
                             "with multi-head latent attention (DeepSeek-V2 / V3)")
        self.lora_slots = slots
        for layer, layer_slots in zip(self.layers, slots.layers):
            layer.self_attn.lora = layer_slots
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora = layer_slots

    def emit_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """EAGLE-3: forward() also returns the residual stream entering ``layers``, after
        the final hidden state on the last axis (one tensor: graphs return one)."""
        self.aux_layers = layers

    def use_ops(self, ops: TorchLayerOps) -> None:
        """Routes every layer's fusable operations to ``ops`` (see layer_ops.py), and takes
        its one-call layer loop for decode steps where it has one for these layers."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        spec = self.layer_stack_spec()
        self.decode_stack = ops.decode_stack(spec) if spec is not None else None

    def layer_stack_spec(self) -> LayerStackSpec | None:
        """The layers as plain data for a backend's one-call loop (layer_stack.py), or None
        where one of them is not a layer that loop computes."""
        layers = []
        for layer in self.layers:
            stacked = layer.stack_layer() if type(layer) is DecoderLayer else None
            if stacked is None:
                return None
            layers.append(stacked)
        if not layers or len({(lay.self_attn.scale, lay.self_attn.softcap, lay.mlp.gelu,
                               lay.input_layernorm.eps) for lay in self.layers}) != 1:
            return None
        first = self.layers[0]
        attn = first.self_attn
        return LayerStackSpec(layers, self.embed_tokens.weight.dtype, attn.num_heads,
                              attn.num_kv_heads, attn.head_dim,
                              first.input_layernorm.eps, attn.scale, attn.softcap,
                              first.mlp.gelu)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[bs, hidden]`` (one row per sequence) -> float32 logits ``[bs, vocab]``."""
        logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap is not None:  # Gemma 2 (and 3 where configured)
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
