"""A prompt's images -> pixels and placeholder tokens, with the checkpoint's own processor
(transformers' ``AutoProcessor`` from the model folder; its Pillow image processor, no
torchvision). Runs where prompts are tokenized: off the event loop and the engine thread.

Fixed-size families (LLaVA) expand every image into the same number of tokens; dynamic-
resolution ones (Qwen2.5-VL) into as many as the processor's resize gives it (its
``image_grid_thw``), the grid kept with the span for M-RoPE and the encoder's packing."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from server.engine.errors import RequestError
from server.engine.multimodal.inputs import ImageSpan
from server.models.vision import AnyVisionConfig, QwenVisionConfig

logger = logging.getLogger(__name__)


def image_hash(image: Any) -> bytes:
    """An image's name for the encoder cache and the prefix cache: its decoded pixels (two
    files of the same picture, a PNG and its WebP twin, share it; any changed pixel does
    not)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()


class ImageInputProcessor:
    """Expands each image placeholder token of a prompt into the rows its image becomes,
    and computes that image's pixels and hash."""

    def __init__(self, folder: str, cfg: AnyVisionConfig, image_limit: int) -> None:
        self.token_id = cfg.image_token_id
        self.image_limit = image_limit
        self.dynamic: QwenVisionConfig | None = None
        if isinstance(cfg, QwenVisionConfig):
            self.dynamic = cfg
            self._load_image_processor(folder, cfg)
            self.per_image = 0  # the processor's resize decides, image by image
            logger.info("Image processor: %s (%s), %s", type(self.image_processor).__name__,
                        self.image_token, cfg.describe())
            return
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model folder {folder}: no image processor could be loaded "
                             f"for this vision model ({str(exc).splitlines()[0]})") from None
        self.image_processor = getattr(processor, "image_processor", None)
        if self.image_processor is None:
            raise ValueError(f"model folder {folder}: its processor has no image processor "
                             "(processor_config.json / preprocessor_config.json)")
        tokenizer = getattr(processor, "tokenizer", None)
        self.image_token = (getattr(processor, "image_token", None)
                            or (tokenizer.convert_ids_to_tokens(cfg.image_token_id)
                                if tokenizer is not None else str(cfg.image_token_id)))
        self.per_image = cfg.tokens_per_image
        self._check_processor(processor)
        logger.info("Image processor: %s (%s), %d tokens per image",
                    type(self.image_processor).__name__, self.image_token, self.per_image)

    def _load_image_processor(self, folder: str, cfg: QwenVisionConfig) -> None:
        """The image processor alone (the whole processor would want a video processor,
        which needs torchvision), with the config's resize bounds (the file's, then
        --mm-processor-kwargs); its patch geometry must be the tower's."""
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                folder, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, ImportError) as exc:
            raise ValueError(f"model folder {folder}: no image processor could be loaded "
                             f"for this vision model ({str(exc).splitlines()[0]})") from None
        self.image_token = tokenizer.convert_ids_to_tokens(cfg.image_token_id)
        ip = self.image_processor
        found = (getattr(ip, "patch_size", None), getattr(ip, "temporal_patch_size", None),
                 getattr(ip, "merge_size", None))
        wanted = (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size)
        if found != wanted:
            raise ValueError(f"the image processor's (patch, temporal patch, merge) sizes "
                             f"{found} are not the vision tower's {wanted}")

    def _check_processor(self, processor: Any) -> None:
        """The processor's own expansion of one image must match the tower's row count:
        a checkpoint whose processor and config disagree fails at start-up, not per
        request."""
        from PIL import Image

        text = getattr(processor, "image_token", None)
        if text is None or not callable(processor):
            return
        ids = processor(text=text, images=[Image.new("RGB", (8, 8))],
                        add_special_tokens=False)["input_ids"][0]
        found = list(ids).count(self.token_id)
        if found != self.per_image:
            raise ValueError(f"the processor expands an image into {found} tokens, the "
                             f"vision tower makes {self.per_image}")

    def process(self, prompt_ids: list[int], images: Sequence[Any], field: str
                ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """(the prompt with each placeholder expanded, each image's span); a RequestError
        naming ``field`` when placeholders and images do not pair up."""
        if len(images) > self.image_limit:
            raise RequestError(f"at most {self.image_limit} images per prompt "
                               f"(--limit-mm-per-prompt); this one has {len(images)}", field)
        found = prompt_ids.count(self.token_id)
        if found != len(images):
            raise RequestError(f"the prompt has {found} image placeholders "
                               f"({self.image_token}) for {len(images)} images", field)
        try:
            out = self.image_processor(list(images), return_tensors="pt")
        except (ValueError, OSError) as exc:
            raise RequestError(f"image could not be processed: {exc}", field) from None
        each = self._each_image(out, field)
        ids: list[int] = []
        spans: list[ImageSpan] = []
        for token in prompt_ids:
            if token != self.token_id:
                ids.append(token)
                continue
            k = len(spans)
            pixels, grid = each[k]
            length = self.per_image if grid is None else grid[0] * grid[1] * grid[2]
            spans.append(ImageSpan(len(ids), length, image_hash(images[k]), pixels, grid))
            ids += [self.token_id] * length
        return ids, tuple(spans)

    def _each_image(self, out: Any, field: str
                    ) -> list[tuple[Any, tuple[int, int, int] | None]]:
        """Each image's pixels and, for a dynamic-resolution model, its token grid (the
        processor's patch grid over the merge size); its patches are rows of one tensor."""
        pixels = out["pixel_values"]
        if self.dynamic is None:
            return [(p, None) for p in pixels]
        merge = self.dynamic.spatial_merge_size
        most = self.dynamic.token_bounds()[1]
        result: list[tuple[Any, tuple[int, int, int] | None]] = []
        at = 0
        for t, h, w in out["image_grid_thw"].tolist():
            grid = (t, h // merge, w // merge)
            if grid[0] * grid[1] * grid[2] > most:  # only a > 200:1 aspect ratio gets here
                raise RequestError(f"an image of {h}x{w} patches is above max_pixels "
                                   f"{self.dynamic.max_pixels} after resizing", field)
            result.append((pixels[at:at + t * h * w], grid))
            at += t * h * w
        return result
