"""The transformer layer CLIP and SigLIP vision towers share (pre-norm attention and MLP,
biases everywhere, Hugging Face's parameter names), used by LLaVA's and Gemma 3's towers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.models.vision.config import VisionConfig


def activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return _QuickGELU()
    if name in ("gelu", "gelu_pytorch_tanh", "gelu_new"):
        return nn.GELU(approximate="none" if name == "gelu" else "tanh")
    raise ValueError(f"vision activation {name!r} is not supported")


class _QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape

        def heads(p: torch.Tensor) -> torch.Tensor:
            return p.view(n, t, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(n, t, h))


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


