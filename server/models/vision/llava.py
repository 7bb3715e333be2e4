"""LLaVA's vision side: a CLIP vision transformer, then a two-layer projector into the
language model's embedding width. Parameter names follow Hugging Face's, so the checkpoint's
``vision_tower.*`` and ``multi_modal_projector.*`` tensors load by name."""

from __future__ import annotations

import torch
from torch import nn

from server.models.errors import ModelFileError
from server.models.vision.config import VisionConfig
from server.models.vision.gemma3 import Gemma3Vision
from server.models.vision.llama4 import Llama4Vision
from server.models.vision.vit import EncoderLayer, activation


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, patches, h]
        cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        # only the layers up to the selected hidden state: the others' output is unused
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers_run))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer up to the hidden state LLaVA selects (no post-norm: the
    selected state is a layer's raw output, as Hugging Face's hidden_states hold it)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = _Encoder(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.act = activation(cfg.projector_act)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size,
                                  bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """Images ``[n, channels, size, size]`` -> embedding rows ``[n, tokens_per_image,
    text_hidden]``: a pure function of tensors, so one compiled graph serves each encoder
    bucket (images per call)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = CLIPVisionTower(cfg)
        self.multi_modal_projector = Projector(cfg)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.vision_tower(pixels.to(self.multi_modal_projector.linear_1.weight.dtype))
        if self.config.feature_select == "default":
            features = features[:, 1:]  # the class token is not an image row
        return self.multi_modal_projector(features)

    def pixel_shape(self) -> tuple[int, int, int]:
        """One image's pixel tensor shape as the processor makes it."""
        c = self.config
        return c.num_channels, c.image_size, c.image_size

    def skips(self, name: str) -> bool:
        """Checkpoint tensors of the tower it does not use: the layers past the selected
        hidden state, the post-norm."""
        if name.startswith("vision_tower.post_layernorm.") or name.endswith("position_ids"):
            return True
        parts = name.split(".")
        return parts[1:3] == ["encoder", "layers"] and int(parts[3]) >= self.config.layers_run


def vision_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`LlavaVision`, or None for a language-model
    tensor. Both layouts: older files (``vision_tower.vision_model.*``) and transformers 5's
    (``model.vision_tower.*``)."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return "vision_tower." + rest
    if name.startswith("multi_modal_projector."):
        return name
    return None


def text_tensor_name(name: str) -> str:
    """A language-model tensor's name as the Llama loader reads it (``model.layers...``,
    ``lm_head.weight``)."""
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model."):  # language_model.lm_head
        return name.removeprefix("language_model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def load_vision(module: LlavaVision | Gemma3Vision | Llama4Vision,
                tensors: dict[str, torch.Tensor], where: str, dry_run: bool = False) -> None:
    """Copies the tower's and projector's tensors in; those the module does not use (its
    ``skips``) are skipped; a missing or misshapen weight is a ModelFileError."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        if module.skips(name):
            continue
        if name not in params:
            raise ModelFileError(f"model file {where}: tensor {name!r} has no place in the "
                                 "vision tower")
        target = params[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelFileError(f"model file {where}: tensor {name!r} has shape "
                                 f"{list(tensor.shape)}, the config calls for "
                                 f"{list(target.shape)}")
        if not dry_run:
            with torch.no_grad():
                target.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFileError(f"model file {where}: the checkpoint lacks vision weights "
                             f"{', '.join(missing[:6])}")
