"""An Anthropic request as the chat request it amounts to: the chat path then renders its
template, plans its tools, samples and reads the output back, as for /v1/chat/completions.

Anthropic's blocks map onto OpenAI's messages: ``system`` becomes the first message, a
``tool_use`` block an assistant ``tool_calls`` entry, a ``tool_result`` block a ``tool``
message (before the user's text of the same turn, where Anthropic requires it), a
``thinking`` block the turn's ``reasoning_content``, an ``image`` block an ``image_url``
part (a data URI of its base64 bytes, or its URL), loaded and checked as chat's images are.
A last assistant turn is continued (Anthropic's prefill), not answered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from server.api.anthropic.protocol import (
    Base64Source,
    CountTokensRequest,
    FileSource,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from server.api.errors import APIError
from server.api.media.chat import ImageRef
from server.api.media.chat import image_refs as chat_image_refs
from server.api.protocol import ChatCompletionRequest

# Request fields of Anthropic's that would change the answer and are not served here:
# refused by name rather than ignored (server-side tools, containers, context editing).
_REFUSED = ("mcp_servers", "container", "context_management")


def check_thinking(req: CountTokensRequest, has_reasoning_parser: bool) -> None:
    """400 for thinking that cannot be served: ``enabled`` (or ``adaptive``) needs
    ``--reasoning-parser`` (it is what finds the thinking in the output), and ``enabled``
    Anthropic's budget rules. The budget is no cap of its own here: thinking and answer
    share ``max_tokens``, as Anthropic counts them."""
    thinking = req.thinking
    if thinking is None or thinking.type == "disabled":
        return
    if not has_reasoning_parser:
        raise APIError(400, f"thinking {thinking.type!r} needs the server started with "
                            "--reasoning-parser (this model's thinking cannot be told from "
                            "its answer without one)", "thinking")
    if thinking.type == "enabled":
        if thinking.budget_tokens is None:
            raise APIError(400, "thinking.budget_tokens: required when thinking is enabled",
                           "thinking.budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({thinking.budget_tokens}) must be "
                                f"less than max_tokens ({max_tokens})",
                           "thinking.budget_tokens")


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``req`` amounts to (400 naming the Anthropic field when one cannot
    be served)."""
    for name in _REFUSED:
        if (req.model_extra or {}).get(name):
            raise APIError(400, f"{name} is not supported by this server (refused rather than "
                                "ignored: it would change the answer)", name,
                           "unsupported_parameter")
    messages = _system(req.system)
    for i, message in enumerate(req.messages):
        messages += _turn(i, message)
    continued = req.messages[-1].role == "assistant"
    fields: dict[str, Any] = dict(
        model=req.model, messages=messages, chat_template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=not continued, continue_final_message=continued)
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    fields.update(_tool_choice(req.tool_choice, bool(req.tools)))
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      user=req.metadata.user_id if req.metadata else None)
        fields.update(_output_config(req))
    return ChatCompletionRequest.model_validate(
        {k: v for k, v in fields.items() if v is not None})


def image_refs(req: CountTokensRequest, chat: ChatCompletionRequest) -> list[ImageRef]:
    """The image parts of ``chat`` (``req`` converted) named by their Anthropic paths: the
    image blocks come in the same order (tool results, which come first in a turn, carry
    none)."""
    names = [(i, j, "data" if isinstance(block.source, Base64Source) else "url")
             for i, message in enumerate(req.messages) if not isinstance(message.content, str)
             for j, block in enumerate(message.content) if isinstance(block, ImageBlock)]
    parts = chat_image_refs(chat)
    assert len(names) == len(parts), "one image part per image block"
    return [ImageRef(part.url, f"messages.{i}.content.{j}.source.{field}",
                     f"messages.{i}.content", j, "image")
            for (i, j, field), part in zip(names, parts)]


def _image_url(block: ImageBlock, where: str) -> str:
    source = block.source
    if isinstance(source, FileSource):
        raise APIError(400, "file sources (Anthropic's Files API) are not supported by this "
                            "server; send the image as base64 or a URL",
                       f"{where}.source.file_id", "unsupported_parameter")
    if isinstance(source, Base64Source):
        return f"data:{source.media_type};base64,{source.data}"
    return source.url


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def _turn(index: int, message: InputMessage) -> list[dict[str, Any]]:
    """One Anthropic turn as OpenAI messages: the tool results it carries, then its text
    (and, for the assistant, its calls and thinking)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[dict[str, Any]] = []  # text and image parts, in order
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            _only_in(message, "user", block.type, where)
            texts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif isinstance(block, ToolUseBlock):
            _only_in(message, "assistant", block.type, where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            _only_in(message, "user", block.type, where)
            results.append(_tool_message(block))
        elif isinstance(block, ThinkingBlock):
            _only_in(message, "assistant", block.type, where)
            reasoning.append(block.thinking)
        else:
            assert isinstance(block, RedactedThinkingBlock)  # opaque: nothing to show
    turn: dict[str, Any] = {"role": message.role}
    if texts:
        plain = len(texts) == 1 and texts[0]["type"] == "text"
        turn["content"] = texts[0]["text"] if plain else texts
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    keep = texts or calls or (message.role == "assistant" and not results)
    return results + ([turn] if keep else [])


def _only_in(message: InputMessage, role: str, kind: str, where: str) -> None:
    if message.role != role:
        raise APIError(400, f"{where}: a {kind} block belongs in a{'n' if role[0] == 'a' else ''}"
                            f" {role} turn, not in a{'n' if message.role[0] == 'a' else ''} "
                            f"{message.role} turn", where)


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    """A tool's answer; a failed call's (``is_error``) says so in the text the model reads,
    as OpenAI's tool messages have no such flag."""
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content)
    if block.is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _tool_choice(choice: ToolChoice | None, has_tools: bool) -> Mapping[str, Any]:
    if choice is None:
        return {}
    parallel = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "auto":
        return {"tool_choice": "auto", **parallel} if has_tools else {}
    if choice.type == "none":
        return {"tool_choice": "none"}
    if choice.type == "any":
        return {"tool_choice": "required", **parallel}
    if not choice.name:
        raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'",
                       "tool_choice.name")
    return {"tool_choice": {"type": "function", "function": {"name": choice.name}}}


def _output_config(req: MessagesRequest) -> Mapping[str, Any]:
    config = req.output_config
    if config is None:
        return {}
    if config.effort is not None:
        raise APIError(400, "output_config.effort is not supported by this server (refused "
                            "rather than ignored: it would change the answer)",
                       "output_config.effort", "unsupported_parameter")
    if config.format is None:
        return {}
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": config.format.json_schema}}}
