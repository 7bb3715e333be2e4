"""Vision towers of vision-language models: what turns an image's pixels into rows of the
language model's embeddings. The language model itself is the Llama-family decoder
(server/models/llama.py); ``config.py`` reads a checkpoint's vision settings, ``llava.py``
builds LLaVA's CLIP tower and projector, ``gemma3.py`` Gemma 3's SigLIP tower and pooling
projector (``vit.py``: the transformer layer both towers share), ``qwen2_5_vl.py``
Qwen2.5-VL's dynamic-resolution tower, ``llama4.py`` Llama 4's tiled tower and pixel-shuffle
adapter. The functions here pick the family's."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from server.models.vision import llama4, llava, qwen2_5_vl
from server.models.vision.config import (
    AnyVisionConfig,
    VisionConfig,
    VisionFamily,
    vision_config_of,
)
from server.models.vision.gemma3 import Gemma3Vision
from server.models.vision.llama4 import Llama4Vision
from server.models.vision.llama4_config import Llama4VisionConfig
from server.models.vision.llava import LlavaVision
from server.models.vision.qwen2_5_vl import QwenVision
from server.models.vision.qwen2_5_vl_config import QwenVisionConfig

# what the engine runs: pixels [n, c, h, w] -> rows [n, tokens_per_image, text hidden]
# (LLaVA, Gemma 3; Llama 4: n tiles), or packed patches -> rows (Qwen2.5-VL, see
# qwen2_5_vl.py)
VisionModel = LlavaVision | Gemma3Vision | QwenVision | Llama4Vision


def build_vision(cfg: AnyVisionConfig) -> VisionModel:
    """The vision side of ``cfg``'s family (weights uninitialised: load_vision fills them)."""
    if isinstance(cfg, QwenVisionConfig):
        return QwenVision(cfg)
    if isinstance(cfg, Llama4VisionConfig):
        return Llama4Vision(cfg)
    if cfg.family is VisionFamily.GEMMA3:
        return Gemma3Vision(cfg)
    return LlavaVision(cfg)


def with_processor_kwargs(cfg: AnyVisionConfig, kwargs: Mapping[str, object]
                          ) -> AnyVisionConfig:
    """The config under ``--mm-processor-kwargs``: a dynamic-resolution processor's resize
    bounds (Qwen2.5-VL, which takes those two only: they size its encoder buckets), Llama
    4's most tiles per image (``max_patches``, the only one it takes: it sizes the tiles
    per encoder call); the other families' processors check their own settings (the
    engine's image processor)."""
    if isinstance(cfg, Llama4VisionConfig):
        for key, value in kwargs.items():
            if key != "max_patches":
                raise ValueError(f"--mm-processor-kwargs: {key!r} is not supported for "
                                 f"{cfg.family} (max_patches)")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError("--mm-processor-kwargs: max_patches must be a tile count "
                                 ">= 1")
        return cfg.with_max_patches(kwargs.get("max_patches"))  # type: ignore[arg-type]
    if not isinstance(cfg, QwenVisionConfig):
        return cfg
    bounds: dict[str, int] = {}
    for key, value in kwargs.items():
        if key not in ("min_pixels", "max_pixels"):
            raise ValueError(f"--mm-processor-kwargs: {key!r} is not supported for "
                             f"{cfg.family} (min_pixels, max_pixels)")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--mm-processor-kwargs: {key} must be a pixel count >= 1")
        bounds[key] = value
    return cfg.with_bounds(bounds.get("min_pixels"), bounds.get("max_pixels"))


def vision_tensor_name(family: VisionFamily, name: str) -> str | None:
    """A checkpoint tensor's name in its family's tower, or None for a language-model
    tensor."""
    if family is VisionFamily.QWEN2_5_VL:
        return qwen2_5_vl.vision_tensor_name(name)
    if family is VisionFamily.LLAMA4:
        return llama4.vision_tensor_name(name)
    return llava.vision_tensor_name(name)


def load_vision(module: VisionModel, tensors: dict[str, torch.Tensor], where: str,
                dry_run: bool = False) -> None:
    if isinstance(module, QwenVision):
        qwen2_5_vl.load_vision(module, tensors, where, dry_run)
    else:
        llava.load_vision(module, tensors, where, dry_run)


__all__ = ["AnyVisionConfig", "Gemma3Vision", "Llama4Vision", "Llama4VisionConfig",
           "LlavaVision", "QwenVision", "QwenVisionConfig",
           "VisionConfig", "VisionFamily", "VisionModel", "build_vision", "load_vision",
           "vision_config_of", "vision_tensor_name", "with_processor_kwargs"]
