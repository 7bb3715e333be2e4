"""A dynamic-resolution model's images -> pixels and placeholder tokens (Qwen2.5-VL): each
placeholder becomes as many tokens as the processor's resize gives its image (its
``image_grid_thw`` over the merge size), the token grid kept with the span for M-RoPE and
the encoder's packing. Runs where prompts are tokenized: off the event loop and the engine
thread."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from server.engine.errors import RequestError
from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.processor import image_hash, run_image_processor
from server.models.vision import QwenVisionConfig

logger = logging.getLogger(__name__)


class DynamicImageProcessor:
    """The checkpoint's image processor alone, through ``AutoImageProcessor`` (Qwen's whole
    processor also wants a video processor, which needs torchvision), with the config's
    resize bounds (its preprocessor_config.json, then --mm-processor-kwargs)."""

    def __init__(self, folder: str, cfg: QwenVisionConfig, image_limit: int) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                folder, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, backend="pil")
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, ImportError) as exc:
            raise ValueError(f"model folder {folder}: no image processor could be loaded "
                             f"for this vision model ({str(exc).splitlines()[0]})") from None
        self.cfg = cfg
        self.token_id = cfg.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(cfg.image_token_id)
        self.image_limit = image_limit
        ip = self.image_processor
        found = (getattr(ip, "patch_size", None), getattr(ip, "temporal_patch_size", None),
                 getattr(ip, "merge_size", None))
        wanted = (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size)
        if found != wanted:  # a checkpoint whose processor and tower disagree
            raise ValueError(f"the image processor's (patch, temporal patch, merge) sizes "
                             f"{found} are not the vision tower's {wanted}")
        logger.info("Image processor: %s (%s), %s", type(ip).__name__, self.image_token,
                    cfg.describe())

    def process(self, prompt_ids: list[int], images: Sequence[Any], field: str
                ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """(the prompt with each placeholder expanded, each image's span); a RequestError
        naming ``field`` when placeholders and images do not pair up."""
        out = run_image_processor(self.image_processor, prompt_ids, images, self.token_id,
                                  self.image_token, self.image_limit, field)
        each = self._each_image(out, field)
        ids: list[int] = []
        spans: list[ImageSpan] = []
        for token in prompt_ids:
            if token != self.token_id:
                ids.append(token)
                continue
            k = len(spans)
            pixels, grid = each[k]
            length = grid[0] * grid[1] * grid[2]
            spans.append(ImageSpan(len(ids), length, image_hash(images[k]), pixels, grid))
            ids += [self.token_id] * length
        return ids, tuple(spans)

    def _each_image(self, out: Any, field: str) -> list[tuple[Any, tuple[int, int, int]]]:
        """Each image's patches (rows of the processor's one tensor) and token grid."""
        pixels = out["pixel_values"]
        merge = self.cfg.spatial_merge_size
        most = self.cfg.token_bounds()[1]
        result: list[tuple[Any, tuple[int, int, int]]] = []
        at = 0
        for t, h, w in out["image_grid_thw"].tolist():
            grid = (t, h // merge, w // merge)
            if grid[0] * grid[1] * grid[2] > most:  # only a > 200:1 aspect ratio gets here
                raise RequestError(f"an image of {h}x{w} patches is above max_pixels "
                                   f"{self.cfg.max_pixels} after resizing", field)
            result.append((pixels[at:at + t * h * w], grid))
            at += t * h * w
        return result
