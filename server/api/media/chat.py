"""A chat request's image parts: counted and refused early (a text-only model, more than
``--limit-mm-per-prompt``), then, on a worker, loaded and handed to the chat template as
its image parts (``{"type": "image"}``, where the template writes the model's placeholder).

The Messages and Responses APIs run as the chat request they amount to; they name each of
its image parts in their own terms (``ImageRef.param``, ``kind``), so that a refusal
points at the field the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError
from server.api.media.loading import load_image
from server.api.protocol import ChatCompletionRequest, ImagePart
from server.engine.multimodal.inputs import VisionInfo


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part of a request: its URL, where it sits in the client's terms (the
    param of an error about the image), ``place``: the param of a refusal of the part as
    a whole (chat's: its content list, as text_fields.py's refusals of other media), its
    index in its content list, and the part's type as the client spelled it."""

    url: str
    param: str
    place: str
    index: int
    kind: str = "image_url"


def image_refs(req: ChatCompletionRequest) -> list[ImageRef]:
    """The request's image parts, in prompt order."""
    refs = []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    refs.append(ImageRef(part.image_url.url,
                                         f"messages.{i}.content.{j}.image_url.url",
                                         f"messages.{i}.content", j))
    return refs


def check_images(vision: VisionInfo | None, refs: list[ImageRef]) -> list[ImageRef]:
    """``refs``, refused (400) where the model reads no images or they are too many;
    cheap (nothing fetched): runs before the request queues."""
    if not refs:
        return refs
    if vision is None:  # the words of text_fields.py's refusal of other media
        first = refs[0]
        raise APIError(400, f"images are not supported by this text-only model (content "
                            f"part {first.index} has type '{first.kind}'); send text parts "
                            "only", first.place)
    if len(refs) > vision.image_limit:
        raise APIError(400, f"at most {vision.image_limit} images per prompt "
                            f"(--limit-mm-per-prompt); this request has {len(refs)}",
                       refs[vision.image_limit].param)  # the first one too many
    return refs


def load_images(refs: list[ImageRef], vision: VisionInfo) -> tuple[Any, ...]:
    """Each image fetched, checked and decoded (blocking: on a worker)."""
    return tuple(load_image(ref.url, vision, ref.param) for ref in refs)


def with_image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a vision model's chat template reads them: every content a list of
    parts, an image part ``{"type": "image"}`` (its pixels travel beside the prompt)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = [{"type": "image"} if p.get("type") == "image_url"
                     else {"type": "text", "text": p.get("text", "")} for p in content]
        else:
            parts = []
        out.append({**message, "content": parts})
    return out
