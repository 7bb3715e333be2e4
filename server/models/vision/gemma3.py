"""Gemma 3's vision side: a SigLIP vision transformer (all its layers and its post-norm),
then Gemma 3's projector: the patch grid average-pooled to ``mm_tokens_per_image`` rows, a
(1 + w) RMS norm and one projection into the language model's width. Parameter names follow
Hugging Face's (``vision_tower.*``, ``multi_modal_projector.*``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.models.vision.config import VisionConfig
from server.models.vision.vit import EncoderLayer


class _Embeddings(nn.Module):
    """SigLIP's: patches with a bias, a learned position per patch, no class token."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, patches, h]
        return patches + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer up to its last hidden state (post-norm applied), as
    Gemma 3 reads it; the attention-pooling head is not part of it."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class _SoftEmbeddingNorm(nn.Module):
    """Gemma's RMS norm: float32, scaled by 1 + w, rounded to the input's dtype after."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.side = cfg.image_size // cfg.patch_size
        self.kernel = self.side // int(round(cfg.mm_tokens_per_image ** 0.5))
        self.mm_soft_emb_norm = _SoftEmbeddingNorm(cfg.hidden_size, cfg.layer_norm_eps)
        # stored [vision hidden, text hidden] (a matmul operand, not a Linear's weight)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(cfg.hidden_size, cfg.text_hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    """Images ``[n, channels, size, size]`` -> embedding rows ``[n, mm_tokens_per_image,
    text_hidden]``: a pure function of tensors, one compiled graph per encoder bucket. The
    rows are not scaled by sqrt(hidden) as the text embeddings are (transformers places
    them after that scaling)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = SiglipVisionTower(cfg)
        self.multi_modal_projector = Gemma3Projector(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))

    def pixel_shape(self) -> tuple[int, int, int]:
        """One image's pixel tensor shape as the processor makes it."""
        c = self.config
        return c.num_channels, c.image_size, c.image_size

    @staticmethod
    def skips(name: str) -> bool:
        """Checkpoint tensors of the tower it does not use: SigLIP's pooling head."""
        return name.startswith("vision_tower.head.") or name.endswith("position_ids")
