"""A prompt's images -> pixels and placeholder tokens, with the checkpoint's own processor
(transformers' ``AutoProcessor`` from the model folder; its Pillow image processor, no
torchvision). Runs where prompts are tokenized: off the event loop and the engine thread."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
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


def run_image_processor(image_processor: Any, prompt_ids: list[int], images: Sequence[Any],
                        token_id: int, image_token: str, image_limit: int, field: str) -> Any:
    """The image processor's output for a prompt's images, after the checks every family
    shares: the per-prompt limit, and one placeholder per image (a RequestError naming
    ``field`` otherwise, as for an image the processor cannot take)."""
    if len(images) > image_limit:
        raise RequestError(f"at most {image_limit} images per prompt "
                           f"(--limit-mm-per-prompt); this one has {len(images)}", field)
    found = prompt_ids.count(token_id)
    if found != len(images):
        raise RequestError(f"the prompt has {found} image placeholders "
                           f"({image_token}) for {len(images)} images", field)
    try:
        return image_processor(list(images), return_tensors="pt")
    except (ValueError, OSError) as exc:
        raise RequestError(f"image could not be processed: {exc}", field) from None


class ImageInputProcessor:
    """Replaces each image placeholder token of a prompt with the tokens its image becomes
    (the processor's own expansion: LLaVA's run of image tokens; Gemma 3's "<start_of_image>"
    becomes the image tokens between begin and end markers and blank lines), and computes
    that image's pixels and hash."""

    def __init__(self, folder: str, cfg: VisionConfig, image_limit: int,
                 processor_kwargs: Mapping[str, Any] | None = None) -> None:
        from transformers import AutoImageProcessor, AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(folder)
            # the Pillow backend everywhere: the same pixels whether torchvision is installed
            # (GPU images) or not, so an image's hash and the answer do not depend on it
            self.image_processor = (AutoImageProcessor.from_pretrained(folder, backend="pil")
                                    if getattr(processor, "image_processor", None) else None)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model folder {folder}: no image processor could be loaded "
                             f"for this vision model ({str(exc).splitlines()[0]})") from None
        if self.image_processor is None:
            raise ValueError(f"model folder {folder}: its processor has no image processor "
                             "(processor_config.json / preprocessor_config.json)")
        self._configure(processor_kwargs or {})
        self.tokenizer = getattr(processor, "tokenizer", None)
        self.image_token = (getattr(processor, "image_token", None)
                            or (self.tokenizer.convert_ids_to_tokens(cfg.image_token_id)
                                if self.tokenizer is not None else str(cfg.image_token_id)))
        # the token the prompt carries per image (Gemma 3's: the begin marker, whose
        # expansion holds the image tokens)
        self.token_id = (self.tokenizer.convert_tokens_to_ids(self.image_token)
                         if self.tokenizer is not None else cfg.image_token_id)
        self.per_image = cfg.tokens_per_image
        self.image_limit = image_limit
        self.replacement, self.span_at = self._replacement(processor, cfg)
        self._newline: dict[int, bool] = {}
        ends = (self.replacement[0], self.replacement[-1])
        # Gemma 3's blank lines around an image merge with a prompt's newlines next to
        # them into one token, as its tokenizer reads the expanded text
        self._merges_newlines = self.tokenizer is not None and any(map(self._is_newline, ends))
        logger.info("Image processor: %s (%s), %d tokens per image",
                    type(self.image_processor).__name__, self.image_token, self.per_image)

    def _configure(self, kwargs: Mapping[str, Any]) -> None:
        """``--mm-processor-kwargs`` set on the image processor, each one it has; what the
        engine does not serve is refused here, at start-up."""
        name = type(self.image_processor).__name__
        for key, value in kwargs.items():
            if not hasattr(self.image_processor, key):
                raise ValueError(f"--mm-processor-kwargs: {key!r} is not a setting of the "
                                 f"model's image processor ({name})")
            setattr(self.image_processor, key, value)
        if getattr(self.image_processor, "do_pan_and_scan", None):
            raise ValueError("do_pan_and_scan (--mm-processor-kwargs or the checkpoint's "
                             "preprocessor_config.json): Gemma 3's pan-and-scan crops are not "
                             "supported; serve it with do_pan_and_scan false (the default)")

    def _replacement(self, processor: Any, cfg: VisionConfig) -> tuple[list[int], int]:
        """(the tokens one placeholder becomes, where its image tokens begin in them), from
        the processor's own expansion of one image; they must be the ``tokens_per_image``
        the tower makes, in one run: a checkpoint whose processor and config disagree
        fails at start-up, not per request."""
        from PIL import Image

        text = getattr(processor, "image_token", None)
        if text is None or not callable(processor):
            return [cfg.image_token_id] * self.per_image, 0
        ids = [int(t) for t in processor(text=text, images=[Image.new("RGB", (8, 8))],
                                         add_special_tokens=False)["input_ids"][0]]
        at = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
        if len(at) != self.per_image:
            raise ValueError(f"the processor expands an image into {len(at)} tokens, the "
                             f"vision tower makes {self.per_image}")
        if at[-1] - at[0] + 1 != len(at):
            raise ValueError("the processor's image tokens are not one run")
        return ids, at[0]

    def _is_newline(self, token: int) -> bool:
        found = self._newline.get(token)
        if found is None:
            assert self.tokenizer is not None
            text = self.tokenizer.decode([token])
            found = self._newline[token] = bool(text) and set(text) == {"\n"}
        return found

    def process(self, prompt_ids: list[int], images: Sequence[Any], field: str
                ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """(the prompt with each placeholder expanded, each image's span); a RequestError
        naming ``field`` when placeholders and images do not pair up."""
        pixels = run_image_processor(self.image_processor, prompt_ids, images, self.token_id,
                                     self.image_token, self.image_limit, field)["pixel_values"]
        ids: list[int] = []
        starts: list[int] = []
        junctions: set[int] = set()
        for token in prompt_ids:
            if token != self.token_id:
                ids.append(token)
                continue
            junctions.add(len(ids))
            starts.append(len(ids) + self.span_at)
            ids += self.replacement
            junctions.add(len(ids))
        if self._merges_newlines:
            ids, starts = self._merge_newlines(ids, junctions, starts)
        spans = tuple(ImageSpan(start, self.per_image, image_hash(image), pixels[k])
                      for k, (start, image) in enumerate(zip(starts, images)))
        return ids, spans

    def _merge_newlines(self, ids: list[int], junctions: set[int], starts: list[int]
                        ) -> tuple[list[int], list[int]]:
        """Each run of newline tokens that a placeholder's expansion meets (``junctions``:
        where expansions begin and end) tokenized again as one text, as the tokenizer reads
        the expanded prompt ("\n" then "\n\n" is Gemma's one "\n\n\n" token); the image
        starts after it shift with it."""
        assert self.tokenizer is not None
        out: list[int] = []
        shifts: list[tuple[int, int]] = []  # (end of a merged run, tokens it gained)
        i = 0
        while i < len(ids):
            j = i
            while j < len(ids) and self._is_newline(ids[j]):
                j += 1
            if j == i:
                out.append(ids[i])
                i += 1
                continue
            run = ids[i:j]
            if any(i < at < j for at in junctions):
                run = self.tokenizer.encode(self.tokenizer.decode(run),
                                            add_special_tokens=False)
                shifts.append((j, len(run) - (j - i)))
            out += run
            i = j
        return out, [s + sum(n for end, n in shifts if s >= end) for s in starts]
