"""Field types and checks for chat content: valid Unicode only, and only what this text-only
model can read. Each failure names its field (pydantic puts the path in ``loc``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

# What a content part of each non-text type is, for the error message. ``image_url`` parts
# pass here: a vision model reads them, a text-only one refuses them by the same words
# (server/api/media/chat.py).
_MEDIA = {
    "input_image": "images", "image": "images",
    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
    "video_url": "video", "video": "video",
    "file": "files", "input_file": "files",
}


def valid_unicode(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``); Python keeps it in the str, but
    no tokenizer, log line or UTF-8 response can hold it, so it is refused here. NUL and
    every other code point pass: the tokenizer encodes them like any character."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # pydantic fills in {name} only (no format specs): the code point is formatted here
        raise PydanticCustomError(
            "invalid_unicode",
            "contains a lone surrogate (U+{code} at index {index}), which is not valid "
            "Unicode; send text as UTF-8 or as paired \\u escapes",
            {"code": f"{ord(text[exc.start]):04X}", "index": exc.start},
        ) from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]


def text_only_parts(content: Any) -> Any:
    """Refuses audio / video / file content parts (and image parts of other APIs' shapes)
    before the union is tried, so the client reads "audio are not supported" rather than
    "Input should be a valid string"."""
    if not isinstance(content, list):
        return content
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _MEDIA:
            raise PydanticCustomError(
                "unsupported_content",
                "{media} are not supported by this text-only model (content part {index} "
                "has type '{kind}'); send text parts only",
                {"media": _MEDIA[kind], "index": index, "kind": kind},
            )
    return content



def no_bool_token_ids(value: Any) -> Any:
    """JSON ``true`` / ``false`` are not token ids (pydantic would read them as 1 / 0): said
    plainly, instead of "Input should be a valid string" from the union's text member."""
    if isinstance(value, list):
        for item in value:
            if isinstance(item, bool) or (
                    isinstance(item, list) and any(isinstance(t, bool) for t in item)):
                raise PydanticCustomError(
                    "int_type", "token ids must be integers, not true or false")
    return value
