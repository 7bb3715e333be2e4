"""A Responses request read as the chat request it amounts to: ``instructions``, the
previous response's conversation and ``input`` become chat messages; ``tools``,
``tool_choice``, ``text.format`` and the sampling fields map to chat's. What the Responses
API has and this server cannot honour is refused with a 400 naming it."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.api.errors import APIError
from server.api.media.chat import ImageRef
from server.api.protocol import ChatCompletionRequest
from server.api.responses.protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    NamedFunctionChoice,
    OtherItem,
    OtherTool,
    OutputItem,
    OutputMessage,
    ReasoningItemParam,
    ReasoningOut,
    ResponsesRequest,
)

_TEXT_PARTS = ("input_text", "output_text", "text")
# the one ``include`` value served: each output_text's tokens with their logprobs (and the
# ``top_logprobs`` best alternatives); as in vLLM and OpenAI, top_logprobs alone asks nothing
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(req: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (req.include or [])


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field whose value this server cannot honour."""
    for i, tool in enumerate(req.tools or []):
        if isinstance(tool, OtherTool):
            _refuse(f"tools[{i}]", f"the built-in tool {tool.type!r} is not available on this "
                                   "server; only function tools are")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, (str, NamedFunctionChoice)):
        _refuse("tool_choice", f"tool_choice of type {choice.type!r} is not supported; send "
                               "auto, none, required or a function")
    for value in req.include or []:
        if value != OUTPUT_LOGPROBS:
            _refuse("include", f"include {value!r} cannot be produced by this server (only "
                               f"{OUTPUT_LOGPROBS!r})")
    if req.truncation == "auto":
        _refuse("truncation", 'truncation "auto" is not supported (a too long context is a '
                              '400); send "disabled"')
    if req.max_tool_calls is not None:
        _refuse("max_tool_calls", "max_tool_calls is not supported")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        _refuse("reasoning", "reasoning summaries cannot be made by this server (reasoning "
                             "is the model's own, split by --reasoning-parser)")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        _refuse("text.verbosity", "text.verbosity is not supported")
    if req.background and not req.store:
        _refuse("background", "background responses need store: true (they are retrieved "
                              "from the store)")
    if req.background and req.stream:
        _refuse("stream", "streaming a background response is not supported; poll it with "
                          "GET /v1/responses/{id}")
    for name in ("prompt", "conversation", "context_management", "prompt_cache_key"):
        if (req.model_extra or {}).get(name):
            _refuse(name, f"{name} is not supported by this server")


def _refuse(param: str, message: str) -> None:
    raise APIError(400, f"{message} (refused rather than ignored: it would change the answer)",
                   param, "unsupported_parameter")


def input_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """``input`` as chat messages (the conversation this request adds), and its
    ``input_image`` parts (the chat messages' image parts, in order) by their paths."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}], []
    messages: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role,
                             "content": _message_content(item.content, where, images)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, where)})
        elif isinstance(item, ReasoningItemParam):
            continue  # templates drop past reasoning
        else:
            assert isinstance(item, OtherItem)
            _refuse(f"{where}.type", f"input items of type {item.type!r} are not supported")
    return messages, images


def history_images(history: list[dict[str, Any]]) -> list[ImageRef]:
    """The image parts a previous response's conversation carries (its input's images),
    named by ``previous_response_id``."""
    return [ImageRef(part["image_url"]["url"], "previous_response_id", "previous_response_id",
                     j, "input_image")
            for message in history if isinstance(message.get("content"), list)
            for j, part in enumerate(message["content"]) if part.get("type") == "image_url"]


def _message_content(content: str | list[ContentPart], where: str, images: list[ImageRef]
                     ) -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or, with images, its text and image parts
    in order (each ``input_image`` appended to ``images``)."""
    if isinstance(content, str) or not any(p.type == "input_image" for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type != "input_image":
            parts.append({"type": "text", "text": _part_text(part, f"{where}.content[{j}]")})
            continue
        param = f"{where}.content[{j}]"
        if part.file_id is not None:
            _refuse(f"{param}.file_id", "input_image file_id needs OpenAI's Files API, which "
                                        "this server does not have; send image_url (a data "
                                        "URI or a URL)")
        if part.image_url is None:
            raise APIError(400, f"{param}: input_image needs image_url (a data URI or a URL)",
                           f"{param}.image_url")
        images.append(ImageRef(part.image_url, f"{param}.image_url", param, j,
                               "input_image"))
        parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def _text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(part, f"{where}.content[{j}]") for j, part in enumerate(content))


def _part_text(part: ContentPart, param: str) -> str:
    if part.type not in _TEXT_PARTS or part.text is None:
        _refuse(param, f"content parts of type {part.type!r} are not supported here (text, "
                       "and input_image in a message)")
    return part.text or ""


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if isinstance(item, ReasoningOut):
            continue
        if isinstance(item, OutputMessage):
            messages.append({"role": "assistant",
                             "content": "".join(part.text for part in item.content)})
            continue
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat request that ``req`` amounts to, with ``conversation`` (the previous
    response's messages and this input) after the instructions."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions
                else []) + conversation
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls, "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "stop": req.stop,
        "ignore_eos": req.ignore_eos, "priority": req.priority, "cache_salt": req.cache_salt,
    }
    if wants_logprobs(req):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort  # the chat template receives it
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True,
                                                                         exclude={"type"})}
                         for t in req.tools if isinstance(t, FunctionTool)]
    if isinstance(req.tool_choice, str):
        body["tool_choice"] = req.tool_choice
    elif isinstance(req.tool_choice, NamedFunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "text.format: json_schema needs a schema", "text.format.schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # e.g. an empty input: no messages at all
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        param = "input" if loc.startswith("messages") else loc
        raise APIError(400, f"{param}: {first['msg']}", param) from None
