"""Llama 4's images -> tiles and placeholder tokens. Each image is resized (keeping its aspect
ratio) onto the canvas of up to ``max_patches`` square tiles that fits it best, padded, cut
into its tiles, and, when it takes more than one, followed by a global thumbnail tile; its
placeholder ``<|image|>`` becomes transformers' Llama4Processor layout::

    <|image_start|> (tile <|tile_x_separator|> ... tile <|tile_y_separator|>) per tile row
    <|image|> thumbnail <|image_end|>

where each tile is a run of ``<|patch|>`` tokens (its rows after the pixel shuffle; a
single-tile image has the thumbnail part only). Every tile is one fixed-size tower input
and one :class:`ImageSpan` of the prompt (named by the image's hash and its place), so
the encoder's buckets count tiles per call.

transformers' Llama4ImageProcessor needs torchvision; this is the same arithmetic in torch
(the canvas choice, a bilinear antialiased resize of the uint8 pixels, zero padding, the
rescale and normalisation in bfloat16, the tiles in row-major order). Runs where prompts
are tokenized: off the event loop and the engine thread."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.processor import image_hash, run_image_processor
from server.models.vision import Llama4VisionConfig

logger = logging.getLogger(__name__)

# Llama4Processor's token strings (processor_config.json may name others)
_TOKENS = {"image_token": "<|image|>", "start_of_image_token": "<|image_start|>",
           "end_of_image_token": "<|image_end|>", "patch_token": "<|patch|>",
           "tile_x_separator_token": "<|tile_x_separator|>",
           "tile_y_separator_token": "<|tile_y_separator|>"}
_BILINEAR = 2  # PIL's resample code, the processor's default


@lru_cache(maxsize=4)
def canvases(max_patches: int, tile: int) -> torch.Tensor:
    """``[k, 2]`` (height, width) of every canvas of at most ``max_patches`` tiles, in
    transformers' order (grouped by aspect ratio, most tiles first): ties go the same way."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_patches, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return torch.tensor([(r * tile, c * tile) for group in by_ratio.values()
                         for r, c in group])


def best_canvas(height: int, width: int, options: torch.Tensor, to_max: bool) -> torch.Tensor:
    """The canvas the image scales onto without distortion: the least upscaling (the most,
    with ``to_max``), else the least downscaling; the smallest area among equals."""
    scales = torch.minimum(options[:, 1] / width, options[:, 0] / height)
    up = scales[scales >= 1]
    if len(up):
        chosen = up.max() if to_max else up.min()
    else:
        chosen = scales[scales < 1].max()
    fits = options[scales == chosen]
    return fits[torch.argmin(fits[:, 0] * fits[:, 1])]


def undistorted_size(height: int, width: int, target: tuple[Any, Any]) -> tuple[int, int]:
    """The largest size of the image's aspect ratio within ``target`` (height, width)."""
    scale_w, scale_h = target[1] / width, target[0] / height
    if scale_w < scale_h:
        return int(min(math.floor(height * scale_w), target[0])), int(target[1])
    return int(target[0]), int(min(math.floor(width * scale_h), target[1]))


class TiledImageProcessor:
    """The checkpoint's tokenizer and its Llama 4 processor settings (processor_config.json,
    preprocessor_config.json), with ``max_patches`` from the config (``--mm-processor-kwargs``
    included). Callable as an image processor: images -> ``pixel_values`` (all tiles, in
    order) and ``aspect_ratios``."""

    def __init__(self, folder: str, cfg: Llama4VisionConfig, image_limit: int) -> None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            pre = _json(Path(folder, "preprocessor_config.json"))
            proc = _json(Path(folder, "processor_config.json"), missing_ok=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model folder {folder}: no image processor could be loaded "
                             f"for this vision model ({str(exc).splitlines()[0]})") from None
        self.cfg = cfg
        self.image_limit = image_limit
        self.tile = cfg.image_size
        self.max_patches = cfg.max_patches
        self.to_max = bool(pre.get("resize_to_max_canvas", False))
        self.rescale = float(pre.get("rescale_factor", 1 / 255))
        self.mean = [float(v) for v in pre.get("image_mean", [0.5] * 3)]
        self.std = [float(v) for v in pre.get("image_std", [0.5] * 3)]
        self.convert_rgb = bool(pre.get("do_convert_rgb", True))
        unsupported = [k for k, default in (("do_resize", True), ("do_rescale", True),
                                            ("do_normalize", True), ("resample", _BILINEAR))
                       if pre.get(k, default) != default]
        if unsupported:
            raise ValueError(f"model folder {folder}: Llama 4 image processor settings "
                             f"{', '.join(unsupported)} are not supported (only the "
                             "processor's defaults)")
        names = {key: str(proc.get(key, default)) for key, default in _TOKENS.items()}
        self.image_token = names["image_token"]
        ids = {key: tokenizer.convert_tokens_to_ids(name) for key, name in names.items()}
        unknown = [names[k] for k, v in ids.items()
                   if v is None or v == tokenizer.unk_token_id]
        if unknown:
            raise ValueError(f"model folder {folder}: the tokenizer lacks Llama 4's image "
                             f"tokens {', '.join(unknown)}")
        if ids["patch_token"] != cfg.image_token_id:
            raise ValueError(f"the processor's patch token {names['patch_token']} "
                             f"({ids['patch_token']}) is not config.json's image_token_id "
                             f"{cfg.image_token_id}")
        self.ids = ids
        self.token_id = ids["image_token"]
        ratio = float(proc.get("pixel_shuffle_ratio", cfg.pixel_shuffle_ratio))
        patch = int(proc.get("patch_size", cfg.patch_size))
        per_tile = (self.tile // patch) ** 2 // int(round(1.0 / ratio ** 2))
        if per_tile != cfg.tokens_per_image:
            raise ValueError(f"the processor expands a tile into {per_tile} tokens, the "
                             f"vision tower makes {cfg.tokens_per_image}")
        self.per_tile = per_tile
        logger.info("Image processor: Llama 4 tiles (%s), %s", self.image_token,
                    cfg.describe())

    def __call__(self, images: Sequence[Any], return_tensors: str = "pt") -> dict[str, Any]:
        tiles, ratios = zip(*(self._tiles(image) for image in images))
        return {"pixel_values": torch.cat(tiles), "aspect_ratios": list(ratios)}

    def _tiles(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        """One image's tiles ``[k, 3, tile, tile]`` bfloat16 (the thumbnail last) and its
        (rows, columns) of tiles."""
        from transformers.image_transforms import convert_to_rgb

        array = convert_to_rgb(image, return_numpy=True) if self.convert_rgb else np.array(image)
        if array.ndim != 3 or array.shape[2] != 3:
            raise ValueError(f"an image of shape {list(array.shape)} is not RGB")
        # [1, 3, h, w] contiguous, as transformers stacks its channel-first images
        pixels = torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).contiguous()
        pixels = pixels[None]
        height, width = pixels.shape[-2:]
        tile = self.tile
        canvas = best_canvas(height, width, canvases(self.max_patches, tile), self.to_max)
        if self.to_max:
            bound = (canvas[0], canvas[1])
        else:  # no upscaling past one tile beyond the image's own size
            bound = (min(max(height, tile), canvas[0]), min(max(width, tile), canvas[1]))
        new_h, new_w = undistorted_size(height, width, bound)
        resized = self._resize(pixels, max(new_h, 1), max(new_w, 1))
        padded = F.pad(resized, (0, int(canvas[1]) - resized.shape[-1],
                                 0, int(canvas[0]) - resized.shape[-2]))
        rows, cols = int(canvas[0]) // tile, int(canvas[1]) // tile
        out = self._normalize(padded).view(3, rows, tile, cols, tile)
        out = out.permute(1, 3, 0, 2, 4).reshape(rows * cols, 3, tile, tile)
        if rows * cols > 1:
            thumb = self._normalize(self._resize(pixels, tile, tile))
            out = torch.cat([out, thumb[None]])
        return out, (rows, cols)

    @staticmethod
    def _resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """uint8 ``[1, 3, h, w]``, bilinear with antialiasing, as torchvision's tensor resize
        does it: on the uint8 values where the CPU has AVX2 or AVX-512, or is ARM (torch's
        fixed-point kernel), else in float32, rounded back."""
        if (height, width) == tuple(pixels.shape[-2:]):
            return pixels
        if (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                or platform.machine() in ("aarch64", "arm64")):
            return F.interpolate(pixels, size=(height, width), mode="bilinear",
                                 align_corners=False, antialias=True)
        out = F.interpolate(pixels.float(), size=(height, width), mode="bilinear",
                            align_corners=False, antialias=True)
        return out.round_().to(torch.uint8)

    def _normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 -> bfloat16, rescaled and normalised in bfloat16 as the processor does."""
        x = pixels[0].to(torch.bfloat16) * self.rescale
        mean = torch.tensor(self.mean, dtype=torch.bfloat16).view(-1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.bfloat16).view(-1, 1, 1)
        return x.sub(mean).div_(std)

    def expansion(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """(the tokens one placeholder becomes, where each tile's patch run begins)."""
        ids, patch = self.ids, self.ids["patch_token"]
        out = [ids["start_of_image_token"]]
        starts: list[int] = []
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    starts.append(len(out))
                    out += [patch] * self.per_tile
                    if x < cols - 1:
                        out.append(ids["tile_x_separator_token"])
                out.append(ids["tile_y_separator_token"])
        out.append(ids["image_token"])
        starts.append(len(out))
        out += [patch] * self.per_tile
        out.append(ids["end_of_image_token"])
        return out, starts

    def process(self, prompt_ids: list[int], images: Sequence[Any], field: str
                ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """(the prompt with each placeholder expanded, one span per tile); a RequestError
        naming ``field`` when placeholders and images do not pair up."""
        out = run_image_processor(self, prompt_ids, images, self.token_id, self.image_token,
                                  self.image_limit, field)
        pixels, ratios = out["pixel_values"], out["aspect_ratios"]
        ids: list[int] = []
        spans: list[ImageSpan] = []
        k = 0  # the image of the next placeholder
        for token in prompt_ids:
            if token != self.token_id:
                ids.append(token)
                continue
            rows, cols = ratios[k]
            expanded, starts = self.expansion(rows, cols)
            name = image_hash(images[k])
            for t, start in enumerate(starts):
                spans.append(ImageSpan(len(ids) + start, self.per_tile, _tile_hash(name, t),
                                       pixels[len(spans)]))
            ids += expanded
            k += 1
        return ids, tuple(spans)


def _tile_hash(image: bytes, index: int) -> bytes:
    """A tile's name for the encoder and prefix caches: its image's hash and its place."""
    return hashlib.sha256(image + b"tile" + index.to_bytes(4, "little")).digest()


def _json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data
