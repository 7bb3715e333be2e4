"""gpt-oss's harmony output format, read incrementally from the detokenized text.

A harmony completion is a sequence of messages, each a header and a body::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

(the prompt ends in ``<|start|>assistant``, so the first message starts at its channel).
The header names the channel (``analysis``: chain of thought; ``commentary``: tool calls and
preambles; ``final``: the answer), maybe a recipient (``to=functions.NAME``, also allowed
before ``<|channel|>``) and a content type (``<|constrain|>json``). ``<|call|>`` and
``<|return|>`` are stop tokens, so the last message usually ends with the text.

The ``openai-harmony`` package parses token ids, but needs its vocabulary downloaded; this
reads the text (detokenized with special tokens kept), piece by piece, split anywhere:
:class:`HarmonyReader` turns pieces into :class:`Event`s, holding back any text that could
still become a marker. Text outside any message (a model that skipped the markup) is a
message of no channel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from server.api.markers import partial_marker

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CONSTRAIN = "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_MARKERS = (START, CHANNEL, *ENDS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class EventKind(Enum):
    BEGIN = "begin"  # a message's header is complete
    TEXT = "text"    # a piece of the current message's body
    END = "end"      # the message ended (its end marker, the next header, or the output)


@dataclass(frozen=True, slots=True)
class Header:
    channel: str | None  # None: text outside any message
    recipient: str | None = None  # "functions.get_weather"
    raw: str = ""  # the header as written, between <|start|> and <|message|>


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    header: Header
    text: str = ""


BARE = Header(None)


def parse_header(raw: str) -> Header:
    """A header's channel and recipient (raw: ``assistant<|channel|>commentary to=...``)."""
    channel = _CHANNEL.search(raw)
    recipient = _RECIPIENT.search(raw)
    return Header(channel.group(1) if channel else None,
                  recipient.group(1) if recipient else None, raw)


class HarmonyReader:
    """One completion's text -> events; ``feed`` pieces, then ``finish``."""

    def __init__(self) -> None:
        self._header: Header | None = None  # the open message's (None: between messages)
        self._raw: str | None = None  # the header being read (None: in a body)
        self._hold = ""

    def feed(self, s: str) -> list[Event]:
        events: list[Event] = []
        buf, self._hold = self._hold + s, ""
        while buf:
            if self._raw is not None:
                header = self._raw + buf
                k = header.find(MESSAGE)
                if k < 0:  # the header goes on
                    self._raw = header
                    return events
                self._header = parse_header(header[:k])
                self._raw = None
                events.append(Event(EventKind.BEGIN, self._header))
                buf = header[k + len(MESSAGE):]
                continue
            at, marker = _first_marker(buf)
            if marker is None:
                held = max(partial_marker(buf, m) for m in _BODY_MARKERS)
                self._hold = buf[len(buf) - held:] if held else ""
                self._text(buf[:len(buf) - held], events)
                return events
            self._text(buf[:at], events)
            self._close(events)
            buf = buf[at + len(marker):]
            if marker in (START, CHANNEL):  # a header follows
                self._raw = "" if marker == START else CHANNEL
        return events

    def finish(self) -> list[Event]:
        """The output ended: held text is the body's; an unfinished header is dropped."""
        events: list[Event] = []
        if self._raw is None:
            self._text(self._hold, events)
        self._hold, self._raw = "", None
        self._close(events)
        return events

    def _text(self, s: str, events: list[Event]) -> None:
        if not s:
            return
        if self._header is None:  # outside any message
            self._header = BARE
            events.append(Event(EventKind.BEGIN, BARE))
        events.append(Event(EventKind.TEXT, self._header, s))

    def _close(self, events: list[Event]) -> None:
        if self._header is not None:
            events.append(Event(EventKind.END, self._header))
            self._header = None


def _first_marker(buf: str) -> tuple[int, str | None]:
    best, found = len(buf), None
    for marker in _BODY_MARKERS:
        k = buf.find(marker, 0, best + len(marker))
        if 0 <= k < best:
            best, found = k, marker
    return best, found
