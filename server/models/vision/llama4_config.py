"""Llama 4's vision settings: the tower's (config.json's vision_config) and the tiling of its
image processor (preprocessor_config.json: the tile size, the most tiles per image). Pure
Python (no torch): the ``buckets`` command plans the encoder from it without loading a
model."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# transformers' Llama4ImageProcessor defaults
DEFAULT_MAX_PATCHES = 16
DEFAULT_TILE_SIZE = 336


@dataclass(frozen=True, slots=True)
class Llama4VisionConfig:
    """Llama 4's vision transformer over one tile of ``image_size`` pixels a side: patches
    embedded by one linear map, a class token, 2-D rotary positions over the patch grid,
    then a pixel shuffle (``pixel_shuffle_ratio``: each 2 x 2 patches become one row) and
    an MLP adapter, and the projector into the language model's width. An image is up to
    ``max_patches`` tiles plus a global thumbnail when it takes more than one (the
    processor's tiling); every tile is one fixed-size tower input."""

    family: Any  # VisionFamily.LLAMA4 (config.py imports this module)
    image_token_id: int  # <|patch|>: the tokens whose embeddings the tower's rows replace
    text_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # the tile size
    patch_size: int
    num_channels: int
    pixel_shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int
    rope_theta: float
    max_patches: int = DEFAULT_MAX_PATCHES  # the processor's most tiles per image
    # image tokens attend causally, as text does (transformers' Llama 4 masks)
    bidirectional: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tokens_per_image(self) -> int:
        """Rows one tile becomes (the encoder's unit: every tile is one input)."""
        return int(self.num_patches * self.pixel_shuffle_ratio ** 2)

    @property
    def max_tiles(self) -> int:
        """Tower inputs one image can take: its tiles, plus the thumbnail when more than
        one."""
        return self.max_patches + (1 if self.max_patches > 1 else 0)

    def check(self) -> None:
        """The sizes the tower's layers must agree on (checked where it is served: a
        checkpoint served as its text model need not have a working tower)."""
        shuffled = int(self.hidden_size / self.pixel_shuffle_ratio ** 2)
        side = self.image_size // self.patch_size
        if self.intermediate_size != shuffled:
            # the adapter's first layer takes the shuffled rows, intermediate_size wide
            raise ValueError(f"Llama 4 vision: intermediate_size {self.intermediate_size} "
                             f"is not the pixel-shuffled width {shuffled}")
        if (side * self.pixel_shuffle_ratio) % 1 or self.image_size % self.patch_size:
            raise ValueError(f"Llama 4 vision: {side}x{side} patches of {self.image_size}-"
                             f"pixel tiles do not shuffle by {self.pixel_shuffle_ratio}")
        if not self.projector_input_dim == self.projector_output_dim == self.vision_output_dim:
            raise ValueError(f"Llama 4 vision: the adapter's widths (projector_input_dim "
                             f"{self.projector_input_dim}, projector_output_dim "
                             f"{self.projector_output_dim}, vision_output_dim "
                             f"{self.vision_output_dim}) differ")

    def with_max_patches(self, max_patches: int | None) -> Llama4VisionConfig:
        return self if max_patches is None else replace(self, max_patches=max_patches)

    def describe(self) -> str:
        return (f"{self.family}, {self.num_layers} layers of width {self.hidden_size}, "
                f"{self.tokens_per_image} image tokens per {self.image_size}x"
                f"{self.image_size} tile, up to {self.max_patches} tiles and a thumbnail")


def llama4_vision_config(hf: Any, family: Any) -> Llama4VisionConfig:
    vision = hf.vision_config
    rope = getattr(vision, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(vision, "rope_theta", 10000.0))
    return Llama4VisionConfig(
        family=family,
        image_token_id=int(hf.image_token_id),
        text_hidden_size=int(hf.text_config.hidden_size),
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.intermediate_size),
        num_layers=int(vision.num_hidden_layers),
        num_heads=int(vision.num_attention_heads),
        image_size=int(vision.image_size),
        patch_size=int(vision.patch_size),
        num_channels=int(getattr(vision, "num_channels", 3)),
        pixel_shuffle_ratio=float(vision.pixel_shuffle_ratio),
        projector_input_dim=int(vision.projector_input_dim),
        projector_output_dim=int(vision.projector_output_dim),
        vision_output_dim=int(vision.vision_output_dim),
        rope_theta=float(theta),
    )


def processor_tiling(folder: str) -> tuple[int, int] | None:
    """(tile size, max_patches) of the folder's preprocessor_config.json (transformers'
    defaults for what it leaves out); None when the folder has none: no image processor,
    the checkpoint is served as its text model."""
    path = Path(folder, "preprocessor_config.json")
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    size = data.get("size") or {}
    tile = int(size.get("height", DEFAULT_TILE_SIZE))
    if int(size.get("width", tile)) != tile:
        raise ValueError(f"{path}: Llama 4's tiles are square, size is {size}")
    return tile, int(data.get("max_patches", DEFAULT_MAX_PATCHES))
