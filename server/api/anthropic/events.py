"""The Messages API's stream: Anthropic's named SSE events.

``message_start`` (the message, empty, with the prompt's usage), ``ping``, then per content
block ``content_block_start``, its ``content_block_delta`` events (``thinking_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``; ``message_delta`` (the
stop reason and final usage) and ``message_stop`` end it. A failure after the first event
travels as an ``error`` event, which the SDK raises as the status's exception.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from enum import Enum
from typing import Any

from server.api.anthropic.answer import signature, stop_reason, tool_use_id, usage
from server.api.anthropic.errors import anthropic_error_body
from server.api.anthropic.protocol import MessageResponse
from server.api.chat_output import DeltaParts
from server.api.errors import stream_error
from server.api.serving_chat import ChatRun
from server.engine.outputs import RequestOutput


class Block(Enum):
    THINKING = "thinking"
    TEXT = "text"
    TOOL_USE = "tool_use"


def event(name: str, data: dict[str, Any]) -> str:
    # allow_nan=False: a NaN fails the stream (an error event) rather than go out unparsable
    return f"event: {name}\ndata: " \
           f"{json.dumps({'type': name, **data}, ensure_ascii=False, allow_nan=False)}\n\n"


class BlockWriter:
    """Turns a completion's deltas into content block events: a block opens when a new
    kind of content (or a new tool call) begins and closes when the next one does."""

    def __init__(self, show_thinking: bool) -> None:
        self.show_thinking = show_thinking
        self.index = -1
        self.open: Block | None = None

    def write(self, parts: DeltaParts) -> list[str]:
        events: list[str] = []
        if parts.reasoning:
            events += self._into(Block.THINKING, {"thinking": "", "signature": ""})
            if self.show_thinking:
                events.append(self._delta({"type": "thinking_delta",
                                           "thinking": parts.reasoning}))
        if parts.content:
            events += self._into(Block.TEXT, {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": parts.content}))
        for call in parts.tool_calls:
            if call.id is not None:  # a call's first delta: its id and name
                events += self.close()
                events += self._start(Block.TOOL_USE, {"id": tool_use_id(call.id),
                                                       "name": call.name or "", "input": {}})
            if call.arguments and self.open is Block.TOOL_USE:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": call.arguments}))
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open is Block.THINKING:
            events.append(self._delta({"type": "signature_delta", "signature": signature()}))
        events.append(event("content_block_stop", {"index": self.index}))
        self.open = None
        return events

    def _into(self, kind: Block, empty: dict[str, Any]) -> list[str]:
        if self.open is kind:
            return []
        return self.close() + self._start(kind, empty)

    def _start(self, kind: Block, block: dict[str, Any]) -> list[str]:
        self.index += 1
        self.open = kind
        return [event("content_block_start", {"index": self.index,
                                              "content_block": {"type": kind.value, **block}})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})


async def message_events(run: ChatRun, message_id: str, model: str, show_thinking: bool
                         ) -> AsyncIterator[str]:
    outputs = aiter(run.stream)
    # message_start states the prompt's size: it waits for the first output, which has it
    first = await anext(outputs, None)
    if first is None:
        return
    start = MessageResponse(id=message_id, model=model, content=[], usage=usage(first, 0))
    yield event("message_start", {"message": start.model_dump()})
    yield event("ping", {})
    reader = run.reader()
    writer = BlockWriter(show_thinking)
    final, last = first, None
    async for out in _chain(first, outputs):
        if not out.outputs:
            continue
        final = out
        completion = last = out.outputs[0]  # Anthropic's messages have one completion
        parts = reader.feed(completion.text) if completion.text else DeltaParts()
        if completion.finish_reason:
            tail = reader.finish()
            parts = DeltaParts(parts.reasoning + tail.reasoning, parts.content + tail.content,
                               parts.tool_calls + tail.tool_calls)
        for item in writer.write(parts):
            yield item
    for item in writer.close():
        yield item
    reason, sequence = stop_reason(last, reader.called) if last else (None, None)
    yield event("message_delta", {
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": usage(final, final.num_generated_tokens).model_dump()})
    yield event("message_stop", {})


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]
                 ) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out


async def guarded_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream, ending in an ``error`` event if the request fails after the first one
    (the 200 is gone by then)."""
    try:
        async for item in events:
            yield item
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        status, message = stream_error(exc)
        body = anthropic_error_body(status, message)
        yield event("error", {k: v for k, v in body.items() if k != "type"})
