"""A streamed response as OpenAI's event sequence: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, its content
part's ``added``, deltas (``output_text``, ``reasoning_text``, ``function_call_arguments``),
``done`` events, ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete``). Each event carries a ``sequence_number`` one higher than the last.

Items open in the order the model writes them: a switch from reasoning to text, or a new
tool call, closes the item before it.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.chat_output import DeltaParts
from server.api.responses.output import item_status, new_id
from server.api.responses.protocol import (
    FunctionCallOut,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOut,
    ReasoningText,
    ResponseObject,
)
from server.api.tool_parsers import ToolCallDelta


class EventWriter:
    """The events of one response, in order; ``items`` is its output so far."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._seq = 0
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOut] = {}  # a tool call's index -> its item
        # include message.output_text.logprobs: the tokens' logprobs not yet sent, given to
        # the next text delta (a token whose text is held back, or reasoning's, rides along)
        self._logprobs: list[dict[str, Any]] = []

    def add_logprobs(self, entries: list[dict[str, Any]]) -> None:
        """Logprobs of tokens generated since the last ``feed`` (before it)."""
        self._logprobs += entries

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        # allow_nan=False: a NaN fails the stream (an error event) instead of going out
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        return self.event(kind, response=response.model_dump(mode="json"))

    def feed(self, parts: DeltaParts) -> list[str]:
        out: list[str] = []
        if parts.reasoning:
            out += self._reasoning(parts.reasoning)
        if parts.content:
            out += self._text(parts.content)
        for call in parts.tool_calls:
            out += self._call(call)
        return out

    def finish(self, finish_reason: str | None) -> list[str]:
        """Closes the open item; an answer with no item at all gets its (empty) message, as
        the whole reading has."""
        out = self._close(item_status(finish_reason))
        if not self.items:
            out += self._open_message() + self._close(item_status(finish_reason))
        return out

    def _index(self, item: OutputItem) -> int:
        return self.items.index(item)

    def _add(self, item: OutputItem) -> list[str]:
        self.items.append(item)
        self._open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item.model_dump(mode="json"))]

    def _open_message(self) -> list[str]:
        item = OutputMessage(id=new_id("msg"), status="in_progress")
        out = self._add(item)
        item.content.append(OutputText(text=""))
        return out + [self.event("response.content_part.added", item_id=item.id,
                                 output_index=self._index(item), content_index=0,
                                 part=OutputText(text="").model_dump())]

    def _text(self, delta: str) -> list[str]:
        out: list[str] = []
        if not isinstance(self._open, OutputMessage):
            out += self._close("completed") + self._open_message()
        item = self._open
        assert isinstance(item, OutputMessage)
        part = item.content[0]
        part.text += delta
        logprobs, self._logprobs = self._logprobs, []
        part.logprobs += logprobs
        return out + [self.event("response.output_text.delta", item_id=item.id,
                                 output_index=self._index(item), content_index=0, delta=delta,
                                 logprobs=logprobs)]

    def _reasoning(self, delta: str) -> list[str]:
        out: list[str] = []
        if not isinstance(self._open, ReasoningOut):
            item = ReasoningOut(id=new_id("rs"), status="in_progress")
            out += self._close("completed") + self._add(item)
            item.content.append(ReasoningText(text=""))
            out.append(self.event("response.content_part.added", item_id=item.id,
                                  output_index=self._index(item), content_index=0,
                                  part=ReasoningText(text="").model_dump()))
        item = self._open
        assert isinstance(item, ReasoningOut)
        item.content[0].text += delta
        return out + [self.event("response.reasoning_text.delta", item_id=item.id,
                                 output_index=self._index(item), content_index=0,
                                 delta=delta)]

    def _call(self, delta: ToolCallDelta) -> list[str]:
        out: list[str] = []
        item = self._calls.get(delta.index)
        if item is None:
            item = FunctionCallOut(id=new_id("fc"), call_id=delta.id or new_id("call"),
                                   name=delta.name or "", arguments="", status="in_progress")
            self._calls[delta.index] = item
            out += self._close("completed") + self._add(item)
        if delta.arguments:
            item.arguments += delta.arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                  output_index=self._index(item), delta=delta.arguments))
        return out

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        out: list[str] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.logprobs += self._logprobs  # tokens whose text never showed (an EOS)
            self._logprobs = []
            out += [self.event("response.output_text.done", item_id=item.id, output_index=index,
                               content_index=0, text=part.text, logprobs=part.logprobs),
                    self.event("response.content_part.done", item_id=item.id,
                               output_index=index, content_index=0, part=part.model_dump())]
        elif isinstance(item, ReasoningOut):
            part = item.content[0]
            out += [self.event("response.reasoning_text.done", item_id=item.id,
                               output_index=index, content_index=0, text=part.text),
                    self.event("response.content_part.done", item_id=item.id,
                               output_index=index, content_index=0, part=part.model_dump())]
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=index, name=item.name, arguments=item.arguments))
        item.status = status if isinstance(item, OutputMessage) else "completed"  # type: ignore[assignment]
        return out + [self.event("response.output_item.done", output_index=index,
                                 item=item.model_dump(mode="json"))]
