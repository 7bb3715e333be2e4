"""Qwen2.5-VL's vision settings, and the arithmetic of its dynamic resolution: how many
patches an image of given pixel bounds can become. Pure Python (no torch): the ``buckets``
command plans the encoder from it without loading a model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# the processor's defaults (transformers' Qwen2VLImageProcessor): 56 x 56 to 1280 tokens
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True, slots=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision transformer: patches of ``temporal_patch_size x patch_size x
    patch_size`` pixels, window attention except in ``fullatt_block_indexes``, and a merger
    of ``spatial_merge_size``\\ :sup:`2` neighbouring patches into one language-model row.
    ``min_pixels`` / ``max_pixels``: the processor's resize bounds (its
    preprocessor_config.json, then ``--mm-processor-kwargs``)."""

    family: Any  # VisionFamily.QWEN2_5_VL (config.py imports this module)
    image_token_id: int
    text_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    num_channels: int
    hidden_act: str
    rope_theta: float
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    # image tokens attend causally, as text does (Gemma 3's attend both ways)
    bidirectional: bool = False

    @property
    def merge_unit(self) -> int:
        """Patches per language-model row."""
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """Values of one patch as the processor flattens it."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_units(self) -> int:
        """A window's side in merged units (rows of the language model)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def token_bounds(self) -> tuple[int, int]:
        """(fewest, most) language-model rows one image becomes: the processor resizes it
        to sides that are multiples of ``patch * merge`` pixels whose product stays within
        the pixel bounds."""
        factor = self.patch_size * self.spatial_merge_size
        most = max(1, self.max_pixels // factor ** 2)
        fewest = max(1, min(most, math.ceil(self.min_pixels / factor ** 2)))
        return fewest, most

    def describe(self) -> str:
        fewest, most = self.token_bounds()
        return (f"{self.family}, {self.num_layers} layers of width {self.hidden_size}, "
                f"{fewest} to {most} image tokens (min_pixels {self.min_pixels}, max_pixels "
                f"{self.max_pixels})")

    def with_bounds(self, min_pixels: int | None, max_pixels: int | None) -> QwenVisionConfig:
        cfg = replace(self, min_pixels=int(min_pixels or self.min_pixels),
                      max_pixels=int(max_pixels or self.max_pixels))
        if cfg.min_pixels > cfg.max_pixels:
            raise ValueError(f"min_pixels {cfg.min_pixels} is above max_pixels "
                             f"{cfg.max_pixels}")
        return cfg


def qwen_vision_config(hf: Any, family: Any) -> QwenVisionConfig:
    vision = hf.vision_config
    act = str(getattr(vision, "hidden_act", "silu"))
    if act != "silu":
        raise ValueError(f"Qwen2.5-VL with a {act!r} vision MLP is not supported (silu)")
    rope = getattr(vision, "rope_parameters", None) or {}
    return QwenVisionConfig(
        family=family,
        image_token_id=int(hf.image_token_id),
        text_hidden_size=int(vision.out_hidden_size),
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.intermediate_size),
        num_layers=int(vision.depth),
        num_heads=int(vision.num_heads),
        patch_size=int(vision.patch_size),
        temporal_patch_size=int(vision.temporal_patch_size),
        spatial_merge_size=int(vision.spatial_merge_size),
        window_size=int(vision.window_size),
        fullatt_block_indexes=tuple(int(i) for i in vision.fullatt_block_indexes),
        num_channels=int(getattr(vision, "in_channels", 3)),
        hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def processor_pixel_bounds(folder: str) -> tuple[int | None, int | None]:
    """The resize bounds of the checkpoint's preprocessor_config.json (either spelling:
    ``size: {shortest_edge, longest_edge}`` or ``min_pixels`` / ``max_pixels``); None
    where it names none."""
    path = Path(folder, "preprocessor_config.json")
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None, None
    size = data.get("size") or {}
    return (data.get("min_pixels") or size.get("shortest_edge"),
            data.get("max_pixels") or size.get("longest_edge"))
