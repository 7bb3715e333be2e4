"""Causal LMs (Llama, Mistral, Qwen2, Qwen3) read as pooling models: a whole right-padded
batch in one pass, causal attention, no KV cache; the final norm's states are pooled (last
token for embedders) or fed to a ``*ForSequenceClassification`` score head.

Module names follow the Hugging Face checkpoints (``layers.N.self_attn.q_proj``...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.models.rotary import rope_inv_freq

# model_type -> (q/k/v biases, per-head q/k RMSNorm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False), "mistral": (False, False), "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    qkv_bias: bool
    qk_norm: bool
    num_labels: int

    @classmethod
    def from_hf(cls, hf: Any) -> DecoderConfig:
        if hf.model_type not in FAMILIES:
            raise ValueError(f"model_type {hf.model_type!r} cannot pool (supported: "
                             f"{', '.join(FAMILIES)})")
        if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True) \
                and hf.model_type == "mistral":
            raise ValueError("sliding-window attention is not supported for pooling")
        bias, qk_norm = FAMILIES[hf.model_type]
        heads = hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
        theta = getattr(hf, "rope_theta", None) or (rope or {}).get("rope_theta", 10000.0)
        scaling = None if not rope or rope.get("rope_type", "default") == "default" else rope
        return cls(hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                   heads, getattr(hf, "num_key_value_heads", None) or heads,
                   getattr(hf, "head_dim", None) or hf.hidden_size // heads, hf.rms_norm_eps,
                   float(theta), scaling, hf.max_position_embeddings,
                   bias or bool(getattr(hf, "attention_bias", False)), qk_norm,
                   getattr(hf, "num_labels", 2))

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bs, n, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(bs, n, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(bs, n, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(bs, n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)
        k = _rotate(k.transpose(1, 2), cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask,
            enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bs, n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderEncoder(nn.Module):
    """Final-norm token states of a right-padded batch (causal attention: a row's pads come
    after its tokens and change nothing); with ``classify`` a ``score`` head too."""

    def __init__(self, cfg: DecoderConfig, classify: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.classify = classify
        if classify:
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling), persistent=False)

    def build_rotary(self, device: torch.device) -> None:
        """RoPE frequencies for real (the model is built on the meta device)."""
        with torch.device(device):
            self.inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta,
                                          self.cfg.rope_scaling).to(device)

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        del token_types
        n = input_ids.shape[1]
        pos = torch.arange(n, device=input_ids.device)
        freqs = torch.outer(pos.float(), self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        mask = (pos[None, :] <= pos[:, None])[None, None]
        x = self.embed_tokens(input_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def head(self, last: torch.Tensor) -> torch.Tensor:
        """Class logits from the last token's states ``[rows, hidden]`` (the head is kept in
        float32)."""
        return self.score(last.to(self.score.weight.dtype))

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("lm_head."):
            return None
        return name
