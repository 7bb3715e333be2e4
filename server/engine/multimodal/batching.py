"""How the images an encoder phase needs become encoder calls of planned shapes, per family:
a batch of equal images padded with blank ones to an image-count bucket (LLaVA, Gemma 3), or images
of any size packed into one sequence padded to a patch-count bucket (Qwen2.5-VL). Each
strategy also makes a bucket's warmup inputs and bounds its working memory."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.plan import EncoderPlan
from server.models.vision import Gemma3Vision, Llama4Vision, LlavaVision, QwenVision, VisionModel
from server.models.vision.qwen2_5_vl import pack_images


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One call of the tower: its shape (``size``: the bucket, or the exact size where
    nothing is padded), its inputs, and how many of its output rows each image owns."""

    size: int
    inputs: tuple[torch.Tensor, ...]
    rows: tuple[int, ...]

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Each image's rows, as copies (a view would keep the padded output alive)."""
        if out.dim() == 3:  # [images, rows, hidden]: one image a batch row
            return [out[i].clone() for i in range(len(self.rows))]
        return [r.clone() for r in torch.split(out[:sum(self.rows)], list(self.rows))]


class EqualImages:
    """LLaVA, Gemma 3 (Llama 4: every tile, one span each): every image is
    ``pixel_shape``; calls of up to the largest bucket's images,
    the last padded up to the smallest bucket that holds the rest (blank images)."""

    def __init__(self, vision: LlavaVision | Gemma3Vision | Llama4Vision, plan: EncoderPlan,
                 padded: bool, device: torch.device, dtype: torch.dtype) -> None:
        self.vision = vision
        self.buckets = list(plan.buckets)
        self.padded = padded
        self.device = device
        self.dtype = dtype
        self.pixel_shape = vision.pixel_shape()

    def calls(self, spans: Sequence[ImageSpan]) -> Iterator[EncoderCall]:
        largest = self.buckets[-1]
        per_image = self.vision.config.tokens_per_image
        for at in range(0, len(spans), largest):
            group = [s.pixels for s in spans[at:at + largest]]
            size = (next(b for b in self.buckets if b >= len(group)) if self.padded
                    else len(group))
            batch = torch.zeros(size, *self.pixel_shape, dtype=self.dtype, device=self.device)
            batch[:len(group)] = torch.stack(group).to(self.device, self.dtype)
            yield EncoderCall(size, (batch,), (per_image,) * len(group))

    def dummy(self, bucket: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(bucket, *self.pixel_shape, dtype=self.dtype, device=self.device),)

    def activation_bytes(self) -> int:
        """A few layer-wide tensors per token (attention scores included) at the largest
        bucket."""
        c = self.vision.config
        tokens = (c.num_patches + 1) * self.buckets[-1]
        per_token = 6 * c.hidden_size + 2 * c.intermediate_size + c.num_heads * (c.num_patches + 1)
        return tokens * per_token * torch.finfo(self.dtype).bits // 8


class PackedImages:
    """Qwen2.5-VL: images of any size packed one after another into calls of at most the
    largest bucket's patches, each padded to the smallest bucket that holds it (an image
    larger than every bucket, which the processor's bounds rule out, runs alone at its own
    size and is counted as a miss)."""

    def __init__(self, vision: QwenVision, plan: EncoderPlan, padded: bool,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.vision = vision
        self.cfg = vision.config
        self.buckets = list(plan.buckets)
        self.padded = padded
        self.device = device
        self.dtype = dtype

    def calls(self, spans: Sequence[ImageSpan]) -> Iterator[EncoderCall]:
        unit = self.cfg.merge_unit
        group: list[ImageSpan] = []
        for span in spans:
            if group and (sum(s.length for s in group) + span.length) * unit > self.buckets[-1]:
                yield self._call(group)
                group = []
            group.append(span)
        if group:
            yield self._call(group)

    def _call(self, group: list[ImageSpan]) -> EncoderCall:
        patches = sum(s.length for s in group) * self.cfg.merge_unit
        size = patches
        if self.padded:
            size = next((b for b in self.buckets if b >= patches), patches)
        packed = pack_images(self.cfg, [s.pixels for s in group],
                             [s.grid for s in group if s.grid is not None], size)
        packed = packed.to(self.device, self.dtype)
        return EncoderCall(size, packed.inputs, packed.rows)

    def dummy(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """Padding only: every patch its own blank."""
        dev = self.device
        pad = torch.full((bucket,), -1, dtype=torch.long, device=dev)
        return (torch.zeros(bucket, self.cfg.patch_dim, dtype=self.dtype, device=dev),
                torch.zeros(bucket, 2, dtype=torch.long, device=dev), pad, pad.clone(),
                torch.arange(bucket // self.cfg.merge_unit, device=dev))

    def activation_bytes(self) -> int:
        """A few layer-wide tensors per patch, the attention scores and the two masks, at
        the largest bucket."""
        c = self.cfg
        n = self.buckets[-1]
        per_patch = 6 * c.hidden_size + 2 * c.intermediate_size + c.num_heads * n
        return n * per_patch * torch.finfo(self.dtype).bits // 8 + 2 * n * n


ImageBatches = EqualImages | PackedImages


def image_batches(vision: VisionModel, plan: EncoderPlan, padded: bool,
                  device: torch.device, dtype: torch.dtype) -> ImageBatches:
    if isinstance(vision, QwenVision):
        return PackedImages(vision, plan, padded, device, dtype)
    return EqualImages(vision, plan, padded, device, dtype)
