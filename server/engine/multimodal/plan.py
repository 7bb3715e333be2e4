"""A vision model's encoder buckets, from its config and the serving limits. Pure Python:
the ``buckets`` command prints the plan without loading a model, and the encoder warms
exactly what it prints."""

from __future__ import annotations

from dataclasses import dataclass

from server.hpu.buckets.encoder import (
    encoder_buckets,
    format_encoder_plan,
    format_patch_plan,
    max_encoder_images,
    max_encoder_patches,
    patch_buckets,
)
from server.models.vision import AnyVisionConfig, Llama4VisionConfig, QwenVisionConfig


@dataclass(frozen=True, slots=True)
class EncoderPlan:
    """``buckets``: images per call (``packed`` False: every image one size; Llama 4:
    tiles per call) or patches per call (``packed``: images of any size packed into one
    sequence)."""

    buckets: tuple[int, ...]
    packed: bool
    description: str


def encoder_plan(cfg: AnyVisionConfig, image_limit: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> EncoderPlan:
    if isinstance(cfg, QwenVisionConfig):
        fewest, most = cfg.token_bounds()
        unit = cfg.merge_unit
        top = max_encoder_patches(image_limit, max_num_seqs, max_num_batched_tokens, most,
                                  unit)
        buckets = patch_buckets(fewest * unit, top, unit)
        return EncoderPlan(tuple(buckets), True,
                           format_patch_plan(buckets, fewest, most, unit))
    # Llama 4: every tile is one input, an image up to max_tiles of them
    tiles = cfg.max_tiles if isinstance(cfg, Llama4VisionConfig) else 1
    buckets = encoder_buckets(max_encoder_images(image_limit * tiles, max_num_seqs,
                                                 max_num_batched_tokens, cfg.tokens_per_image))
    pixels = f"{cfg.num_channels}x{cfg.image_size}x{cfg.image_size}"
    return EncoderPlan(tuple(buckets), False,
                       format_encoder_plan(buckets, cfg.num_patches, pixels,
                                           "tiles" if tiles > 1 else "images"))
