"""Image input (vision-language models): vLLM's flags for how many images a prompt may
carry and where they may come from, and the limits that keep a hostile image from costing
memory before it is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.config.fields import flag, knob

GROUP = "Multimodal (image input)"
MODALITIES = ("image",)
# Pillow's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): about 89.5 megapixels
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485


def parse_mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's JSON object, e.g. ``{"image": 2}``."""
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt {text}: expected JSON such as "
                         "'{\"image\": 2}'") from None
    if not isinstance(data, dict):
        raise ValueError(f"--limit-mm-per-prompt {text}: expected a JSON object")
    limits: dict[str, int] = {}
    for modality, count in data.items():
        if modality not in MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: modality {modality!r} is not served "
                             f"(served: {', '.join(MODALITIES)})")
        if isinstance(count, dict):  # vLLM's newer form {"image": {"count": 2, ...}}
            count = count.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality} must be a count >= 0")
        limits[modality] = count
    return limits


def parse_processor_kwargs(text: str) -> dict[str, object]:
    """``--mm-processor-kwargs``: vLLM's JSON object of settings for the checkpoint's
    processor, e.g. ``{"do_pan_and_scan": false}``; empty: none."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"--mm-processor-kwargs {text}: expected JSON such as "
                         "'{\"do_pan_and_scan\": false}'") from None
    if not isinstance(data, dict):
        raise ValueError(f"--mm-processor-kwargs {text}: expected a JSON object")
    return data


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """What a request's images may be: how many per prompt, where from, how large."""

    limit_mm_per_prompt: str = flag(
        '{"image": 4}', group=GROUP, metavar="JSON",
        help="most items of each modality in one prompt, as JSON (vLLM's flag); it also "
             "sizes the vision encoder's buckets")
    mm_processor_kwargs: str = flag(
        "", group=GROUP, metavar="JSON",
        help="settings of the checkpoint's image processor, as JSON (vLLM's flag); each "
             "must be one the processor has, and the engine must serve it (Gemma 3's "
             "do_pan_and_scan: true is refused); Qwen2.5-VL: min_pixels / max_pixels, the "
             "image size bounds that also size its encoder buckets")
    allowed_local_media_path: str = flag(
        "", group=GROUP, metavar="DIR",
        help="a folder whose files requests may name as file:// image URLs (unset: none)")
    image_fetch_timeout: float = knob(
        5.0, env="VLLM_IMAGE_FETCH_TIMEOUT",
        help="seconds an http(s) image URL may take to answer and arrive")
    max_image_bytes: int = knob(
        20 * 2**20, env="HPU_SERVE_MAX_IMAGE_BYTES",
        help="largest encoded image accepted (a data URI, a file, a download), in bytes")
    max_image_pixels: int = knob(
        DEFAULT_MAX_IMAGE_PIXELS, env="HPU_SERVE_MAX_IMAGE_PIXELS",
        help="largest image accepted, in pixels (width x height, read from the header "
             "before anything is decoded)")
    mm_encoder_cache_images: int = knob(
        64, env="HPU_SERVE_ENCODER_CACHE_IMAGES",
        help="encoded images kept for reuse (keyed by the image's hash; least recently used "
             "dropped)")

    def __post_init__(self) -> None:
        self.limits  # noqa: B018 - checks the JSON at start-up
        self.processor_kwargs  # noqa: B018
        if self.image_fetch_timeout <= 0:
            raise ValueError("VLLM_IMAGE_FETCH_TIMEOUT must be > 0")
        if self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("the image size limits must be >= 1")
        if self.mm_encoder_cache_images < 1:
            raise ValueError("HPU_SERVE_ENCODER_CACHE_IMAGES must be >= 1")

    @property
    def limits(self) -> dict[str, int]:
        return parse_mm_limits(self.limit_mm_per_prompt)

    @property
    def processor_kwargs(self) -> dict[str, object]:
        return parse_processor_kwargs(self.mm_processor_kwargs)

    @property
    def image_limit(self) -> int:
        return self.limits.get("image", 4)
