"""A prompt's images -> pixels and placeholder tokens, with the checkpoint's own processor
(transformers' ``AutoProcessor`` from the model folder; its Pillow image processor, no
torchvision). Runs where prompts are tokenized: off the event loop and the engine thread."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from server.engine.errors import RequestError
from server.engine.multimodal.inputs import ImageSpan
from server.models.vision import VisionConfig

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

    def __init__(self, folder: str, cfg: VisionConfig, image_limit: int) -> None:
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
        self.token_id = cfg.image_token_id
        self.per_image = cfg.tokens_per_image
        self.image_limit = image_limit
        self._check_processor(processor)
        logger.info("Image processor: %s (%s), %d tokens per image",
                    type(self.image_processor).__name__, self.image_token, self.per_image)

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
            pixels = self.image_processor(list(images), return_tensors="pt")["pixel_values"]
        except (ValueError, OSError) as exc:
            raise RequestError(f"image could not be processed: {exc}", field) from None
        ids: list[int] = []
        spans: list[ImageSpan] = []
        for token in prompt_ids:
            if token != self.token_id:
                ids.append(token)
                continue
            k = len(spans)
            spans.append(ImageSpan(len(ids), self.per_image, image_hash(images[k]),
                                   pixels[k]))
            ids += [self.token_id] * self.per_image
        return ids, tuple(spans)
