"""Fields of vLLM's pooling requests that this server does not implement: refused with a 400
naming the field when the value would change the answer, accepted (and ignored) when it
would not, as ``server/api/request_checks.py`` does for chat and completions. Unknown fields
outside these tables (``priority``, ``cache_salt``, ``request_id``...) stay ignored, as
OpenAI ignores what it does not know."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from server.api.errors import APIError


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _only(*harmless: Any) -> Callable[[Any], bool]:
    return lambda value: _unset(value) or value in harmless


# field -> whether the value changes nothing
_ANY: Mapping[str, Callable[[Any], bool]] = {
    # multimodal inputs: none here
    "mm_processor_kwargs": _unset,
    "media_io_kwargs": _unset,
    # padding every input to max_length changes the vectors of mask-less models
    "padding": _only("do_not_pad"),
    # truncate_prompt_tokens keeps the last tokens (vLLM's left side); keeping the first is
    # not implemented
    "truncation_side": _only("left"),
}
_ENCODED: Mapping[str, Callable[[Any], bool]] = {
    **_ANY,
    # base64 carries float32 little-endian values (OpenAI's); other widths or orders are not
    # implemented (x86 and Arm hosts are little-endian, so "native" is "little")
    "embed_dtype": _only("float32"),
    "endianness": _only("native", "little"),
}
_CHAT: Mapping[str, Callable[[Any], bool]] = {
    **_ENCODED,
    # a template from the request runs on the server: refused, as chat refuses it
    "chat_template": _unset,
    "continue_final_message": _unset,
    "tools": _unset,
    "documents": _unset,
}


def reject_unsupported(req: BaseModel, *, encoded: bool = False, chat: bool = False) -> None:
    """400 naming the first unknown field whose value would change the answer.
    ``encoded``: the answer carries vectors (embed_dtype...); ``chat``: ``messages`` input."""
    table = _CHAT if chat else _ENCODED if encoded else _ANY
    for name, value in (req.model_extra or {}).items():
        harmless = table.get(name)
        if harmless is not None and not harmless(value):
            raise APIError(400, f"{name} is not supported by this server (refused rather than "
                                "ignored: it would change the answer)", name,
                           "unsupported_parameter")
