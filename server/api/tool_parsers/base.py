"""The results (OpenAI's tool calls and their streamed deltas) and the parsers' common machine."""

from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from server.api.markers import partial_marker

_ALNUM = string.ascii_letters + string.digits
_rng = random.SystemRandom()


def new_call_id() -> str:
    return "call_" + "".join(_rng.choices(_ALNUM, k=24))


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)


@dataclass(slots=True)
class ExtractedToolCalls:
    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---- the parsers' base ------------------------------------------------------------------

class ToolParser(ABC):
    """One instance per completion; ``feed`` pieces of output, then ``finish``."""

    name: ClassVar[str] = ""
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._out = StreamDelta()
        self._ncalls = 0
        self._ws = ""        # leading whitespace of the content, held until text follows
        self._spoke = False  # some non-whitespace content went out
        self._gap = False    # a call went out since the last content
        self._hold = ""      # text that may start a tag
        self._pend = ""      # text of an undecided call, content if it turns out no call
        self._state = "start"

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output's calls and content (a fresh machine: this one's state is kept)."""
        p = type(self)()
        p._run(text)
        p._end()
        calls: dict[int, ToolCall] = {}
        for d in p._out.tool_calls:
            if d.index in calls:
                calls[d.index].arguments += d.arguments
            else:
                calls[d.index] = ToolCall(d.name or "", d.arguments, d.id or new_call_id())
        return ExtractedToolCalls(list(calls.values()), p._out.content or None)

    def feed(self, delta_text: str) -> StreamDelta:
        """The next piece of output (split anywhere) -> what can be sent now."""
        self._run(delta_text)
        return self._take()

    def finish(self) -> StreamDelta:
        """End of output: held text becomes content, a call cut short gets its closing."""
        self._end()
        return self._take()

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _run(self, s: str | None) -> None:
        while s:
            s = self._step(s)

    @abstractmethod
    def _step(self, s: str) -> str | None:
        """Consumes a prefix of ``s`` (each format's machine); returns the rest."""

    @abstractmethod
    def _end(self) -> None:
        """The output ended: settle what is held back."""

    def _new_id(self) -> str:
        return new_call_id()

    def _text(self, s: str) -> None:
        if self._gap:  # whitespace right after a call is layout, not content
            s = s.lstrip()
            self._gap = not s
        if s and not self._spoke:
            if s.isspace():
                self._ws += s
                return
            s, self._ws, self._spoke = self._ws + s, "", True
        self._out.content += s

    def _call(self, name: str, arguments: str = "") -> int:
        self._out.tool_calls.append(ToolCallDelta(self._ncalls, self._new_id(), name, arguments))
        self._gap = True
        self._ncalls += 1
        return self._ncalls - 1

    def _args(self, index: int, fragment: str) -> None:
        calls = self._out.tool_calls
        if calls and calls[-1].index == index:
            calls[-1].arguments += fragment
        elif fragment:
            calls.append(ToolCallDelta(index, arguments=fragment))

    def _until(self, s: str, tag: str, emit: Callable[[str], Any]) -> str | None:
        """Text before ``tag`` goes to ``emit``; the text after it, or None (tag not yet seen)."""
        buf = self._hold + s
        k = buf.find(tag)
        if k >= 0:
            self._hold = ""
            emit(buf[:k])
            return buf[k + len(tag):]
        n = partial_marker(buf, tag)
        self._hold = buf[len(buf) - n:] if n else ""
        emit(buf[:len(buf) - n])
        return None

    def _give_up(self, s: str, state: str) -> str:
        """The undecided call was none: its text becomes content."""
        self._text(self._pend)
        self._pend, self._state = "", state
        return s
