"""The ``openai`` parser: gpt-oss's tool calls, harmony messages to a recipient
(``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``,
server/api/harmony.py). A call's id and name go out once its header is complete, its
arguments as they are written. ``final`` and ``commentary`` text without a recipient (and
text outside any message) is content; ``analysis`` is the reasoning, which
``--reasoning-parser openai_gptoss`` reads (without it, it is left out, as vLLM does)."""

from __future__ import annotations

from server.api.harmony import Event, EventKind, HarmonyReader
from server.api.tool_parsers.base import ToolParser


class OpenAIToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True  # harmony's markers are special tokens

    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()
        self._index: int | None = None  # the call being written

    def _step(self, s: str) -> str | None:
        self._read(self._reader.feed(s))
        return None

    def _end(self) -> None:
        self._read(self._reader.finish())

    def _read(self, events: list[Event]) -> None:
        for event in events:
            header = event.header
            if event.kind is EventKind.BEGIN:
                if header.recipient is not None:
                    self._index = self._call(header.recipient.removeprefix("functions."))
            elif event.kind is EventKind.END:
                self._index = None
            elif self._index is not None:
                self._args(self._index, event.text)
            elif header.channel != "analysis":
                self._text(event.text)
