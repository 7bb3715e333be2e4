"""Where a prompt's images sit: one span of placeholder tokens per image, named by the
image's hash. A leaf module (no torch): the scheduler, the block manager and the API read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image of a prompt: its placeholder tokens ``[offset, offset + length)``, whose
    embeddings the vision encoder supplies, and its hash (the encoder cache's key and part
    of the prefix-cache names of the blocks it touches)."""

    offset: int
    length: int
    hash: bytes
    # the processor's pixel tensor of this one image (torch), kept to encode it again
    # after the encoder cache dropped it (a preempted request computes its prompt anew)
    pixels: Any = field(default=None, compare=False, repr=False)
    # dynamic-resolution models (Qwen2.5-VL): the image's tokens as a (frames, rows,
    # columns) grid, t * h * w == length; their M-RoPE positions and the encoder's packing
    # follow it. None: every image is one fixed size
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class VisionInfo:
    """What the API needs to know of a vision-language model: how many images a prompt
    may carry (``--limit-mm-per-prompt``) and the media rules (allowed folder, fetch
    timeout, size caps) of server/config/multimodal.py."""

    image_limit: int
    allowed_local_media_path: str
    fetch_timeout: float
    max_image_bytes: int
    max_image_pixels: int


def block_images(spans: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The hashes of the images whose tokens fall in ``[start, end)`` (a KV block), for its
    prefix-cache name: two prompts with the same placeholder tokens but other images never
    share the block."""
    return b"".join(s.hash for s in spans if s.offset < end and start < s.end)


def chunk_end(spans: Sequence[ImageSpan], start: int, end: int, limit: int) -> int:
    """Where a prompt chunk ``[start, end)`` ends without cutting an image in two (an
    image's tokens are placed together, and Gemma 3's attend to each other both ways):
    before the image it would cut, or, when that image begins at ``start`` (or before it:
    a prefix-cache hit that ends inside the image), after it if that is within ``limit``
    (the step's token budget; else ``start``: nothing fits this step)."""
    for span in spans:
        if span.offset < end < span.end:
            if span.offset > start:
                return span.offset
            return span.end if span.end <= limit else start
    return end
