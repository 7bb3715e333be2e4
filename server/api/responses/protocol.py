"""OpenAI Responses API wire schemas (pydantic only; no logic, no engine imports).

Requests are read leniently where OpenAI is (``type`` may be left out of a message item);
items and tools this server cannot honour are kept as plain objects so that the handler
can refuse them with a 400 naming them, rather than failing validation with a vague one.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from server.api.protocol import INT64_MAX, INT64_MIN, OpenAIModel, RequestModel, StopText
from server.api.text_fields import Text


class ResponseStatus(str, enum.Enum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self not in (ResponseStatus.QUEUED, ResponseStatus.IN_PROGRESS)


# --- request -----------------------------------------------------------------------------

class ContentPart(OpenAIModel):
    """``input_text`` / ``output_text`` (a history turn's) and ``input_image`` are read;
    other part types (``input_file``, ``refusal``...) are refused by the handler."""

    type: Annotated[str, Field(max_length=64)]
    text: Text | None = None
    # input_image: a data URI or a URL (chat's image_url rules, server/api/media); an
    # uploaded file's id is refused (no Files API here)
    image_url: str | None = Field(None, min_length=1)
    file_id: str | None = None
    # OpenAI's resolution hint; LLaVA's processor has one resolution, so it changes nothing
    detail: Literal["auto", "low", "high"] | None = None


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: Text = Field(max_length=256)
    name: Text = Field(max_length=256)
    arguments: Text = Field("{}", max_length=1024 * 1024)
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: Text = Field(max_length=256)
    output: Text | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItemParam(OpenAIModel):
    """A previous turn's reasoning sent back; chat templates leave it out of the history."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


class OtherItem(OpenAIModel):
    """Any other item type (``item_reference``, a built-in tool's call...): refused."""

    model_config = {"extra": "allow"}
    type: str


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return kind if kind in _ITEM_KINDS else "other"


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItemParam, Tag("reasoning")] | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind)]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OtherTool(OpenAIModel):
    """A built-in tool (``web_search``, ``file_search``, ``code_interpreter``, MCP...):
    refused."""

    model_config = {"extra": "allow"}
    type: str


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "other"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                 Discriminator(_tool_kind)]


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class OtherToolChoice(OpenAIModel):
    """Forcing a built-in tool, or ``allowed_tools``: refused."""

    model_config = {"extra": "allow"}
    type: str


def _choice_kind(choice: Any) -> str:
    return "function" if _tool_kind(choice) == "function" else "other"


ToolChoice = Annotated[Annotated[NamedFunctionChoice, Tag("function")]
                       | Annotated[OtherToolChoice, Tag("other")], Discriminator(_choice_kind)]


class TextFormat(OpenAIModel):
    """``text.format``: ``{"type": "text" | "json_object" | "json_schema", ...}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    # "schema" on the wire (a name pydantic models keep for themselves)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenAIModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``. Unknown fields are ignored, as for chat; known ones this
    server cannot honour are refused (server/api/responses/inputs.py)."""

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    tools: list[Tool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    background: bool = False
    stream: bool = False
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None,
                                                                            max_length=16)
    user: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = Field(None, ge=1)
    # vLLM's sampling extras, as its ResponsesRequest takes them
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=20.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopText | list[StopText] | None = None
    ignore_eos: bool = False
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: the response carries the raw prompt and output (input_messages /
    # output_messages: text with special tokens, and token ids)
    enable_response_messages: bool = False


# --- response ----------------------------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningOut(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """OpenAI's ``Response``."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    background: bool = False
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    # vLLM's, with enable_response_messages (null otherwise)
    input_messages: list[dict[str, Any]] | None = None
    output_messages: list[dict[str, Any]] | None = None
