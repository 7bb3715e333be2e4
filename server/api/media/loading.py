"""One image URL -> a decoded RGB image, refusing on the way (a 400 naming the problem)
what would cost memory or time out of proportion: files past the byte cap, images past the
pixel cap (read from the header, before a pixel is decoded), unsupported formats, truncated
or corrupt data, slow or unreachable servers. Blocking: runs on the preprocess workers."""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any
from urllib.parse import unquote, urlparse

from server.api.errors import APIError
from server.engine.multimodal.inputs import VisionInfo

# Pillow's format names -> the media types a data URI may say
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}


def load_image(url: str, rules: VisionInfo, param: str) -> Any:
    """The image ``url`` names, decoded to RGB (a PIL image)."""
    return decode_image(read_image_bytes(url, rules, param), rules, param)


def read_image_bytes(url: str, rules: VisionInfo, param: str) -> bytes:
    """The encoded bytes behind ``url``, at most ``rules.max_image_bytes`` of them."""
    if url.startswith("data:"):
        return _data_uri(url, rules, param)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return _local_file(url, rules, param)
    if scheme in ("http", "https"):
        return _download(url, rules, param)
    raise APIError(400, f"image URL scheme {scheme or 'none'!r} is not supported (data:, "
                        "http(s): or file://)", param)


def _too_big(size: int, rules: VisionInfo, param: str) -> APIError:
    return APIError(400, f"image is {size} bytes, more than the limit of "
                         f"{rules.max_image_bytes} (HPU_SERVE_MAX_IMAGE_BYTES)", param)


def _data_uri(url: str, rules: VisionInfo, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    media_type = header[len("data:"):].split(";")[0].strip().lower()
    if not comma or not header.endswith(";base64"):
        raise APIError(400, "image data URI must be base64 (data:image/png;base64,...)", param)
    if media_type not in _MEDIA_TYPES:
        raise APIError(400, f"unsupported image type {media_type or 'none'!r} (PNG, JPEG "
                            "or WebP)", param)
    if len(payload) * 3 // 4 > rules.max_image_bytes:  # before decoding the base64
        raise _too_big(len(payload) * 3 // 4, rules, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "image data URI is not valid base64", param) from None


def _local_file(url: str, rules: VisionInfo, param: str) -> bytes:
    allowed = rules.allowed_local_media_path
    if not allowed:
        raise APIError(400, "file:// image URLs need the server started with "
                            "--allowed-local-media-path", param)
    parsed = urlparse(url)
    path = os.path.realpath(unquote(parsed.netloc + parsed.path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise APIError(400, f"image file {path} is outside --allowed-local-media-path "
                            f"{root}", param)
    try:
        size = os.path.getsize(path)
        if size > rules.max_image_bytes:
            raise _too_big(size, rules, param)
        with open(path, "rb") as f:
            return f.read(rules.max_image_bytes + 1)
    except OSError as exc:
        raise APIError(400, f"image file {path} cannot be read: {exc.strerror}", param) from None


def _download(url: str, rules: VisionInfo, param: str) -> bytes:
    import httpx

    try:
        with httpx.Client(timeout=rules.fetch_timeout, follow_redirects=True) as client, \
                client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise APIError(400, f"image URL {url} answered HTTP {resp.status_code}",
                               param)
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and \
                    int(declared) > rules.max_image_bytes:
                raise _too_big(int(declared), rules, param)
            data = bytearray()
            for chunk in resp.iter_bytes():
                data += chunk
                if len(data) > rules.max_image_bytes:
                    raise _too_big(len(data), rules, param)
            return bytes(data)
    except httpx.TimeoutException:
        raise APIError(400, f"image URL {url} did not answer within "
                            f"{rules.fetch_timeout:g} s (VLLM_IMAGE_FETCH_TIMEOUT)",
                       param) from None
    except httpx.HTTPError as exc:
        raise APIError(400, f"image URL {url} could not be fetched: "
                            f"{type(exc).__name__}: {exc}", param) from None


def decode_image(data: bytes, rules: VisionInfo, param: str) -> Any:
    """Decodes ``data`` after its header passed the checks (format, pixel count)."""
    from PIL import Image, UnidentifiedImageError

    # this check replaces Pillow's own (Image.MAX_IMAGE_PIXELS, the same 89.5 megapixels by
    # default): Pillow's raises inside open() without the size, ours names it
    Image.MAX_IMAGE_PIXELS = None
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:
        raise APIError(400, "image is not a PNG, JPEG or WebP file (or its header is "
                            "corrupt)", param) from None
    except Image.DecompressionBombError:  # Pillow's own check, at twice its threshold
        raise _too_many_pixels(None, rules, param) from None
    width, height = image.size
    if width * height > rules.max_image_pixels or width < 1 or height < 1:
        raise _too_many_pixels((width, height), rules, param)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(400, f"image is truncated or corrupt ({exc})", param) from None


def _too_many_pixels(size: tuple[int, int] | None, rules: VisionInfo, param: str) -> APIError:
    what = f"{size[0]}x{size[1]} pixels" if size is not None else "too many pixels"
    return APIError(400, f"image is {what}, more than the limit of {rules.max_image_pixels} "
                         "pixels (HPU_SERVE_MAX_IMAGE_PIXELS); refused from its header, "
                         "before decoding", param)
