"""Which processor expands a vision model's image placeholders: the checkpoint's whole
processor for the fixed-size families (processor.py: LLaVA, Gemma 3), its image processor
alone for dynamic resolution (dynamic_processor.py: Qwen2.5-VL), Llama 4's tiling
(tile_processor.py)."""

from __future__ import annotations

from collections.abc import Mapping

from server.engine.multimodal.dynamic_processor import DynamicImageProcessor
from server.engine.multimodal.processor import ImageInputProcessor
from server.engine.multimodal.tile_processor import TiledImageProcessor
from server.models.vision import (
    AnyVisionConfig,
    Llama4VisionConfig,
    QwenVisionConfig,
    with_processor_kwargs,
)

ImagePrompts = ImageInputProcessor | DynamicImageProcessor | TiledImageProcessor


def image_prompts(folder: str, cfg: AnyVisionConfig, image_limit: int,
                  processor_kwargs: Mapping[str, object]) -> ImagePrompts:
    """``processor_kwargs``: ``--mm-processor-kwargs`` (refused at start-up where the
    processor has no such setting or the engine does not serve it)."""
    if isinstance(cfg, QwenVisionConfig):
        return DynamicImageProcessor(folder, with_processor_kwargs(cfg, processor_kwargs),
                                     image_limit)
    if isinstance(cfg, Llama4VisionConfig):
        return TiledImageProcessor(folder, with_processor_kwargs(cfg, processor_kwargs),
                                   image_limit)
    return ImageInputProcessor(folder, cfg, image_limit, processor_kwargs)
