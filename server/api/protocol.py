"""OpenAI wire schemas (pydantic only; no logic, no engine imports)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    SerializerFunctionWrapHandler,
    StrictInt,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from server.api.text_fields import Text, no_bool_token_ids, text_only_parts

# OpenAI's published ranges (API specification 2.3.0); configurable limits that depend on
# the deployment (--max-logprobs, --max-stop-strings...) are in request_checks.py.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# top_k beyond the vocabulary is clamped (as vLLM does); beyond int32 it is a typo.
INT32_MAX = 2**31 - 1


StopText = Annotated[Text, Field(min_length=1)]


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do; known fields are type-checked.
    # ``Infinity`` / ``NaN`` (which Python's JSON parser accepts) are never valid numbers.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(OpenAIModel):
    # A request body keeps its unknown fields, so that the ones that would change the
    # answer (tools, response_format...) can be refused instead of silently ignored.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def now() -> int:
    return int(time.time())


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ImageURL(OpenAIModel):
    # a data: URI (PNG, JPEG, WebP), an http(s) URL, or a file:// path under
    # --allowed-local-media-path; fetched and checked by server/api/media
    url: str = Field(min_length=1)
    # OpenAI's resolution hint; LLaVA's processor has one resolution, so it changes nothing
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


def _part_type(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    if not isinstance(kind, str):  # a list or object as "type": no member matches
        return None
    return {"text": "part[text]", "image_url": "part[image_url]"}.get(kind)


# Tags spelled as pydantic spells a type ("part[text]"), so an error's param stays the
# field's path (messages.0.content.0.text), as errors.py drops type tags from it
ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("part[text]")], Annotated[ImagePart, Tag("part[image_url]")]],
    Discriminator(_part_type),
]


class FunctionCall(OpenAIModel):
    name: Text = Field(max_length=256)
    arguments: Text = Field("{}", max_length=1024 * 1024)  # JSON text, as OpenAI sends it


class ToolCallParam(OpenAIModel):
    """A call in an assistant message of the history."""

    id: Text | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    # OpenAI's roles are system, user, assistant, developer and tool; like vLLM, any other
    # name goes to the chat template as it is (a template that does not know it says so)
    role: Annotated[Text, Field(min_length=1, max_length=64)]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, max_length=1024)
    tool_call_id: Text | None = Field(None, max_length=256)
    # a previous turn's reasoning, when a client sends it back (templates may use it)
    reasoning_content: Text | None = None

    _text_only = field_validator("content", mode="before")(text_only_parts)


class FunctionDefinition(OpenAIModel):
    # OpenAI's rule for function names; the name also goes into a grammar
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


# A constraint's text; its size is bounded by the engine, against --max-grammar-bytes and
# --max-grammar-alternatives (a 400 naming the field and the flag), not here.
SpecText = Text


class JsonSchemaFormat(OpenAIModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str | None = Field(None, max_length=256)
    description: str | None = None
    # "schema" in the wire format (a name pydantic models keep for themselves)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` object."""

    json_schema: dict[str, Any] | SpecText | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: SpecText | None = None
    choice: list[Annotated[Text, Field(max_length=4096)]] | None = Field(None, min_length=1)
    grammar: SpecText | None = None


class SamplingFields(RequestModel):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extras)."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    # OpenAI allows 0 (only the most likely token); the engine takes (0, 1], see serving.py
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | list[StopText] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: Text | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # vLLM takes any value > 0; below 0.01 the division overflows the logits to inf and the
    # distribution to NaN (garbage tokens), so such values are refused
    repetition_penalty: float | None = Field(None, ge=0.01, le=20.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: with --scheduling-policy priority, lower values are served first
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # output constraints (server/api/structured.py): at most one per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | SpecText | None = None
    guided_regex: SpecText | None = None
    guided_choice: list[Annotated[Text, Field(max_length=4096)]] | None = Field(
        None, min_length=1)
    guided_grammar: SpecText | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text
    return_token_ids: bool = False
    # vLLM's: logprob tokens as "token_id:N" instead of their text
    return_tokens_as_token_ids: bool = False
    # vLLM's: only these tokens may be sampled
    allowed_token_ids: list[StrictInt] | None = Field(None, min_length=1, max_length=1 << 20)
    # vLLM's: only the prompt's last k tokens are kept (-1: the context's worth)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    # vLLM's: which end the truncation cuts ("left", the default: the last tokens stay)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: requests share cached KV blocks only with requests of the same salt
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    # vLLM's: each prompt token's logprob and the top k (-1: the whole vocabulary), not
    # with stream (request_checks.py); bounded by --max-logprobs
    prompt_logprobs: StrictInt | None = None
    # vLLM's: words never to generate
    bad_words: list[Annotated[Text, Field(min_length=1, max_length=4096)]] | None = Field(
        None, max_length=1024)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        # OpenAI and vLLM refuse it: options of a stream that will not be sent
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the last message stays open for the model to continue (a prefilled answer)
    continue_final_message: bool = False
    # vLLM's: documents for a RAG chat template (each a dict such as {"title", "text"})
    documents: list[dict[str, Text]] | None = Field(None, max_length=1024)
    tools: list[ChatTool] | None = Field(None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # extra variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; as in vLLM the chat template receives it (``reasoning_effort``): a template
    # that reads it (gpt-oss) follows it, any other renders the same prompt
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: the answer starts with the last message's content when that message has the
    # answer's role (continue_final_message)
    echo: bool = False


class CompletionRequest(SamplingFields):
    # strict: JSON true / false are not token ids 1 / 0
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]] | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    # 0 only with echo: the prompt back, nothing generated (vLLM's reading). Unset: 16, the
    # legacy completions default of OpenAI and vLLM; null: up to the context length
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    suffix: Text | None = None

    _token_ids = field_validator("prompt", mode="before")(no_bool_token_ids)


def _invocation_kind(body: Any) -> str:
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


class InvocationRequest(RootModel[Union[ChatCompletionRequest, CompletionRequest]]):
    """SageMaker's ``POST /invocations`` (vLLM serves it): a body with ``messages`` is a chat
    request, any other a completion request."""

    root: Annotated[Union[Annotated[ChatCompletionRequest, Tag("chat")],
                          Annotated[CompletionRequest, Tag("completion")]],
                    Discriminator(_invocation_kind)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # with --enable-prompt-tokens-details (vLLM's), else left out
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_unset_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details", 0) is None:
            del data["prompt_tokens_details"]
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None  # OpenAI requires the key (null: this model never refuses)
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    # vLLM's current name, and the older one many clients (DeepSeek-style) still read
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    # vLLM's: with prompt_logprobs, per prompt token {token id: {logprob, rank,
    # decoded_token}} (None for the first); null otherwise, as vLLM answers
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # beside reasoning_content, as for a whole message
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # this chunk's, with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str
    prompt_token_ids: list[int] | None = None  # the first chunk's, with return_token_ids


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with return_token_ids (streamed: the prompt's in a choice's first chunk only)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # vLLM's (not streamed): as on a chat response
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hpu-serve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """vLLM's ``POST /tokenize`` body: a ``prompt``, or chat ``messages`` rendered by the
    chat template as chat completions render them."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # unset: true for a prompt, false for messages (vLLM's defaults: a chat template writes
    # its own BOS)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = Field(None, max_length=256)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the vocabulary strings


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[StrictInt]

    _token_ids = field_validator("tokens", mode="before")(no_bool_token_ids)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's, with --enable-tokenizer-info-endpoint): the
    tokenizer's own settings, its class and chat template; other keys vary by tokenizer."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI: a string or null (vLLM sends the status as an int)
    request_id: str | None = None  # the X-Request-Id it answers (hpu-serve's addition)


class ResetPrefixCacheResponse(BaseModel):
    status: Literal["ok"] = "ok"
    dropped_blocks: int  # cached prefix blocks forgotten


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ErrorResponse(BaseModel):
    error: ErrorInfo

