"""Anthropic's Messages API wire schemas (pydantic only; no logic, no engine imports).

Requests keep their unknown fields (``extra="allow"``) so that the few that would change
the answer can be refused by name (server/api/anthropic/convert.py); the rest are ignored,
as Anthropic's own fields that mean nothing here (``cache_control``, ``service_tier``...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from server.api.protocol import INT32_MAX
from server.api.text_fields import Text

# Anthropic's rule for tool names (a name also goes into a grammar)
TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: Text


class ToolUseBlock(AnthropicModel):
    """A call the assistant made, in the history."""

    type: Literal["tool_use"]
    id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(min_length=1, max_length=256)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(AnthropicModel):
    """The answer to a call, in a user turn: text, or a list of text blocks."""

    type: Literal["tool_result"]
    tool_use_id: Text = Field(min_length=1, max_length=256)
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _refuse_media(value, "a tool_result block's content")


class ThinkingBlock(AnthropicModel):
    """A previous turn's reasoning, sent back (its signature is not checked)."""

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str = ""


class Base64Source(AnthropicModel):
    """An image's bytes in the request (its media type is checked with the bytes, by the
    same loader as chat's data URIs: server/api/media)."""

    type: Literal["base64"]
    media_type: Text = Field(max_length=255)
    data: str


class URLSource(AnthropicModel):
    """An image fetched by the server (http(s), or file:// under
    --allowed-local-media-path), with chat's caps and timeout."""

    type: Literal["url"]
    url: str = Field(min_length=1)


class FileSource(AnthropicModel):
    """An upload of Anthropic's Files API: refused by name (this server has no files)."""

    type: Literal["file"]
    file_id: str


ImageSource = Annotated[Union[Base64Source, URLSource, FileSource],
                        Field(discriminator="type")]


class ImageBlock(AnthropicModel):
    """An image in a user turn (a vision-language model; a text-only one refuses it)."""

    type: Literal["image"]
    source: ImageSource


def _block_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


InputBlock = Annotated[Union[
    Annotated[TextBlock, Tag("text")],
    Annotated[ToolUseBlock, Tag("tool_use")],
    Annotated[ToolResultBlock, Tag("tool_result")],
    Annotated[ThinkingBlock, Tag("thinking")],
    Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Annotated[ImageBlock, Tag("image")],
], Discriminator(_block_type)]

# Anthropic's other media blocks: refused by name, not as "no such tag" (images are read
# in a turn's content; a text-only model refuses them in server/api/media/chat.py)
_MEDIA_BLOCKS = {"document": "documents", "search_result": "search results",
                 "container_upload": "files"}


def _refuse_media(content: Any, images_in: str | None = None) -> Any:
    """``images_in``: where an image block cannot go (None: images are welcome)."""
    from pydantic_core import PydanticCustomError

    if not isinstance(content, list):
        return content
    for index, block in enumerate(content):
        kind = _block_type(block)
        if kind == "image" and images_in is not None:
            raise PydanticCustomError(
                "unsupported_content",
                "images are not supported in {where} (content block {index}); send the "
                "image in the user turn's content instead", {"where": images_in,
                                                             "index": index})
        if kind in _MEDIA_BLOCKS:
            raise PydanticCustomError(
                "unsupported_content",
                "{media} are not supported by this text-only model (content block {index} "
                "has type '{kind}'); send text blocks only",
                {"media": _MEDIA_BLOCKS[kind], "index": index, "kind": kind})
    return content


class InputMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: Text | list[InputBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _refuse_media(value)


class Tool(AnthropicModel):
    name: str = Field(pattern=TOOL_NAME)
    description: Text | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(AnthropicModel):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one named), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024, le=INT32_MAX)
    # "omitted": the thinking block comes back empty (only its signature)
    display: Literal["summarized", "omitted"] | None = None


class Metadata(AnthropicModel):
    user_id: Text | None = Field(None, max_length=256)


class OutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(AnthropicModel):
    """``POST /v1/messages/count_tokens``: what a message's prompt would hold."""

    model: Text = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=256)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # vLLM's: extra variables for the chat template
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[Annotated[Text, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


# --- the answer ----------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


ContentOut = Annotated[Union[TextOut, ToolUseOut, ThinkingOut], Field(discriminator="type")]


class AnthropicUsage(BaseModel):
    """Anthropic's accounting: ``input_tokens`` are the prompt tokens computed for this
    request; those the prefix cache served are ``cache_read_input_tokens`` (their sum is
    the prompt's size, what count_tokens answers)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body (the SDK picks its exception class from the status)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None
