"""Llama 4's vision side: a vision transformer over one tile (patches embedded by one linear
map, a class token appended, learned positions, 2-D rotary positions over the patch grid in
every layer's attention), then a pixel shuffle that folds each 2 x 2 patches into one row, a
two-layer MLP adapter and the projector into the language model's width. Parameter names
follow Hugging Face's (``vision_model.*``, ``multi_modal_projector.*``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.models.vision.llama4_config import Llama4VisionConfig

# transformers builds every layer norm of the tower with LayerNorm's default eps, whatever
# the config's norm_eps says
_EPS = 1e-5


def _rotary_angles(cfg: Llama4VisionConfig) -> torch.Tensor:
    """``[patches + 1, head_dim / 2]`` float32: the angle of each interleaved pair of a
    head, per token. The first half of the pairs turns with the patch's column, the second
    with its row (both counted from 1); the class token (last) does not turn."""
    side = cfg.image_size // cfg.patch_size
    index = torch.arange(side * side)
    half = cfg.head_dim // 2
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    columns = (index % side + 1).float()[:, None] * freq
    rows = (index // side + 1).float()[:, None] * freq
    angles = torch.cat([columns, rows], dim=-1)
    return torch.cat([angles, torch.zeros(1, angles.shape[1])])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[n, t, heads, head_dim]``: each pair ``(x0, x1), (x2, x3)...`` turned by its
    angle, in float32 (Meta's complex product), back in x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return turned.flatten(-2).type_as(x)


class _Attention(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape

        def heads(p: torch.Tensor) -> torch.Tensor:
            return p.view(n, t, self.num_heads, -1)

        q = _rotate(heads(self.q_proj(x)), cos, sin).transpose(1, 2)
        k = _rotate(heads(self.k_proj(x)), cos, sin).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)).transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(n, t, h))


class _MLP(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=_EPS)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=_EPS)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.num_layers))


class _PatchEmbedding(nn.Module):
    """Non-overlapping patches, each flattened (channel, row, column) and mapped by one
    linear layer: transformers' unfold + linear, without the unfold."""

    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.patch = cfg.patch_size
        self.linear = nn.Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size,
                                bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        n, c, height, width = pixels.shape
        p = self.patch
        patches = pixels.view(n, c, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.linear(patches.reshape(n, (height // p) * (width // p), c * p * p))


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[n, side * side, c]`` -> ``[n, side * side * ratio^2, c / ratio^2]``: each
    ``1 / ratio`` x ``1 / ratio`` patches folded into one row, in transformers' order
    (the width folded first, then the height of the transposed grid)."""
    n, tokens, c = x.shape
    side = int(round(tokens ** 0.5))
    folded = int(side * ratio)
    grid = x.view(n, side, folded, int(c / ratio))  # columns folded into channels
    grid = grid.transpose(1, 2).reshape(n, folded, folded, int(c / ratio ** 2))
    return grid.transpose(1, 2).reshape(n, folded * folded, -1)


class _AdapterMLP(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.projector_input_dim, bias=False)
        self.fc2 = nn.Linear(cfg.projector_output_dim, cfg.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class _Adapter(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.ratio = cfg.pixel_shuffle_ratio
        self.mlp = _AdapterMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(x, self.ratio))


class Llama4VisionTower(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = _PatchEmbedding(cfg)
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.positional_embedding_vlm = nn.Parameter(
            torch.zeros(cfg.num_patches + 1, cfg.hidden_size))
        self.layernorm_pre = nn.LayerNorm(cfg.hidden_size, eps=_EPS)
        self.layernorm_post = nn.LayerNorm(cfg.hidden_size, eps=_EPS)
        self.model = _Encoder(cfg)
        self.vision_adapter = _Adapter(cfg)
        angles = _rotary_angles(cfg)
        self.register_buffer("rotary_cos", angles.cos(), persistent=False)
        self.register_buffer("rotary_sin", angles.sin(), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)
        x = self.layernorm_pre(x)
        # [tokens, 1, pairs]: broadcast over the heads
        cos, sin = self.rotary_cos[:, None], self.rotary_sin[:, None]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]  # the class token is not a row
        return self.vision_adapter(x)


class Llama4Projector(nn.Module):
    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cfg.vision_output_dim, cfg.text_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)


class Llama4Vision(nn.Module):
    """Tiles ``[n, channels, size, size]`` -> embedding rows ``[n, tokens_per_image,
    text_hidden]``: a pure function of tensors, one compiled graph per encoder bucket
    (tiles per call)."""

    def __init__(self, cfg: Llama4VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_model = Llama4VisionTower(cfg)
        self.multi_modal_projector = Llama4Projector(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        return self.multi_modal_projector(self.vision_model(pixels.to(dtype)))

    def pixel_shape(self) -> tuple[int, int, int]:
        """One tile's pixel tensor shape as the processor makes it."""
        c = self.config
        return c.num_channels, c.image_size, c.image_size

    @staticmethod
    def skips(name: str) -> bool:
        """Checkpoint tensors it does not use: the rotary table (computed here)."""
        return name.endswith(("freqs_ci", "position_ids"))


def vision_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`Llama4Vision`, or None for a language-model
    tensor."""
    name = name.removeprefix("model.")
    if name.startswith(("vision_model.", "multi_modal_projector.")):
        return name
    return None
