"""What an Anthropic answer says about a finished completion: its content blocks, why it
stopped, and its usage. Used whole (a message) and at the end of a stream alike."""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.api.anthropic.protocol import (
    AnthropicUsage,
    ContentOut,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
)
from server.api.chat_output import MessageParts
from server.engine.outputs import CompletionOutput, RequestOutput


def tool_use_id(call_id: str) -> str:
    """Anthropic's ids of tool calls start ``toolu_`` (the parsers make OpenAI's ``call_``)."""
    return "toolu_" + call_id.removeprefix("call_")


def signature() -> str:
    """A thinking block's signature. Anthropic signs its own thinking so that it can trust
    it when sent back; this server reads returned thinking as plain history, so the
    signature is an opaque id that only keeps clients (and their SDKs) content."""
    return uuid.uuid4().hex


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` is; ``{}`` for a call cut
    short by max_tokens (its stop_reason says so)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(parts: MessageParts, show_thinking: bool) -> list[ContentOut]:
    """Thinking first, then the text, then each call (the order the model wrote them in)."""
    blocks: list[ContentOut] = []
    if parts.reasoning:
        blocks.append(ThinkingOut(thinking=parts.reasoning if show_thinking else "",
                                  signature=signature()))
    if parts.content:
        blocks.append(TextOut(text=parts.content))
    blocks += [ToolUseOut(id=tool_use_id(c.id), name=c.name, input=tool_input(c.arguments))
               for c in parts.tool_calls]
    return blocks


def stop_reason(completion: CompletionOutput, called: bool
                ) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence). An aborted request (the engine went to sleep) has
    neither."""
    if completion.finish_reason == "stop":
        if called:
            return "tool_use", None
        if isinstance(completion.stop_reason, str):
            return "stop_sequence", completion.stop_reason
        return "end_turn", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    return None, None


def usage(out: RequestOutput, output_tokens: int) -> AnthropicUsage:
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return AnthropicUsage(input_tokens=len(out.prompt_token_ids) - cached,
                          output_tokens=output_tokens, cache_read_input_tokens=cached)
