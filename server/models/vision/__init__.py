"""Vision towers of vision-language models: what turns an image's pixels into rows of the
language model's embeddings. The language model itself is the Llama-family decoder
(server/models/llama.py); ``config.py`` reads a checkpoint's vision settings, ``llava.py``
builds LLaVA's CLIP tower and projector, ``qwen2_5_vl.py`` Qwen2.5-VL's dynamic-resolution
tower. The functions here pick the family's."""

from __future__ import annotations

import torch

from server.models.vision import llava, qwen2_5_vl
from server.models.vision.config import (
    AnyVisionConfig,
    VisionConfig,
    VisionFamily,
    vision_config_of,
)
from server.models.vision.llava import LlavaVision
from server.models.vision.qwen2_5_vl import QwenVision
from server.models.vision.qwen2_5_vl_config import QwenVisionConfig

# a vision-language checkpoint's tower, whichever family it is
VisionModule = LlavaVision | QwenVision


def build_vision(cfg: AnyVisionConfig) -> VisionModule:
    if isinstance(cfg, QwenVisionConfig):
        return QwenVision(cfg)
    return LlavaVision(cfg)


def with_processor_kwargs(cfg: AnyVisionConfig, kwargs: dict[str, int]) -> AnyVisionConfig:
    """The config under ``--mm-processor-kwargs`` (the resize bounds of a dynamic-resolution
    processor); a ValueError where the family has no such setting."""
    if isinstance(cfg, QwenVisionConfig):
        return cfg.with_bounds(kwargs.get("min_pixels"), kwargs.get("max_pixels"))
    if kwargs:
        raise ValueError(f"--mm-processor-kwargs {', '.join(kwargs)}: {cfg.family} resizes "
                         "every image to one size (the setting is for dynamic-resolution "
                         "models such as Qwen2.5-VL)")
    return cfg


def vision_tensor_name(family: VisionFamily, name: str) -> str | None:
    """A checkpoint tensor's name in its family's tower, or None for a language-model
    tensor."""
    if family is VisionFamily.QWEN2_5_VL:
        return qwen2_5_vl.vision_tensor_name(name)
    return llava.vision_tensor_name(name)


def load_vision(module: VisionModule, tensors: dict[str, torch.Tensor], where: str,
                dry_run: bool = False) -> None:
    if isinstance(module, QwenVision):
        qwen2_5_vl.load_vision(module, tensors, where, dry_run)
    else:
        llava.load_vision(module, tensors, where, dry_run)


__all__ = ["AnyVisionConfig", "LlavaVision", "QwenVision", "QwenVisionConfig", "VisionConfig",
           "VisionFamily", "VisionModule", "build_vision", "load_vision", "vision_config_of",
           "vision_tensor_name", "with_processor_kwargs"]
