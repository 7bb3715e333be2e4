"""Reasoning parsers: split a model's thinking (``reasoning_content``) from its answer
(``content``), whole or streamed.

``split`` runs the streaming machine over the whole output, so both always agree. Text that
might be the start of a marker (``"</th"``) is held back until the next piece decides it.
Reasoning is kept as written (None when empty or only whitespace); the answer loses its
leading whitespace (the newlines models put after ``</think>``).
"""

from __future__ import annotations

from typing import ClassVar

from server.api.harmony import MESSAGE, START, EventKind, HarmonyReader
from server.api.markers import partial_marker


class ReasoningParser:
    """One instance per completion: ``feed`` pieces of output, then ``finish``."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # True when the prompt already opened the reasoning (the output starts inside it)
    opened_by_prompt: ClassVar[bool] = False
    # the markers are special tokens that detokenizing must keep (harmony)
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._state = "start"  # "start" (undecided), "reasoning", "content"
        self._hold = ""
        self._ws = ""          # leading whitespace of the reasoning, held until text follows
        self._reasoned = self._answered = False
        self._out = ["", ""]

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning" or (self._state == "start" and self.opened_by_prompt)

    def split(self, text: str) -> tuple[str | None, str | None]:
        p = type(self)()
        p._run(text)
        p._end()
        return p._out[0] or None, p._out[1] or None

    def feed(self, delta_text: str) -> tuple[str, str]:
        self._run(delta_text)
        return self._take()

    def finish(self) -> tuple[str, str]:
        self._end()
        return self._take()

    def _take(self) -> tuple[str, str]:
        out, self._out = self._out, ["", ""]
        return out[0], out[1]

    def _reason(self, s: str) -> None:
        if s and not self._reasoned:
            if s.isspace():
                self._ws += s
                return
            s, self._ws, self._reasoned = self._ws + s, "", True
        self._out[0] += s

    def _answer(self, s: str) -> None:
        if not self._answered:
            s = s.lstrip()
            self._answered = bool(s)
        self._out[1] += s

    def _run(self, s: str) -> None:
        if self._state == "start":
            buf = self._hold + s
            t = buf.lstrip()
            if t.startswith(self.start):
                s, self._state = t[len(self.start):], "reasoning"
            elif self.start.startswith(t):
                self._hold = buf
                return
            else:
                s, self._state = buf, "reasoning" if self.opened_by_prompt else "content"
            self._hold = ""
        if self._state == "reasoning":
            buf = self._hold + s
            k = buf.find(self.end)
            if k < 0:
                n = partial_marker(buf, self.end)
                self._hold = buf[len(buf) - n:] if n else ""
                self._reason(buf[:len(buf) - n])
                return
            self._hold = ""
            self._reason(buf[:k])
            s, self._state = buf[k + len(self.end):], "content"
        self._answer(s)

    def _end(self) -> None:
        if self._state == "reasoning" or (self._state == "start" and self.opened_by_prompt):
            self._reason(self._hold)
        else:
            self._answer(self._hold)
        self._hold = ""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """The chat template opened ``<think>``: all is reasoning up to ``</think>`` (a ``<think>``
    the model writes first is dropped); no ``</think>`` at all -> all reasoning."""

    name = "deepseek_r1"
    opened_by_prompt = True


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the output starts with ``<think>`` (unclosed -> all reasoning);
    otherwise all content (thinking disabled with ``enable_thinking=False``)."""

    name = "qwen3"


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony messages (server/api/harmony.py): the ``analysis`` channel is the
    reasoning; ``final``, preambles on ``commentary`` and text outside any message are the
    answer. A message to a recipient (a tool call) stays in the answer as harmony markup,
    whole (``<|start|>`` header ``<|message|>`` arguments ``<|call|>``), for the ``openai``
    tool parser to read."""

    name = "openai_gptoss"
    start = "<|channel|>analysis<|message|>"
    end = "<|channel|>final<|message|>"  # where a constraint on the answer starts
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()

    def _run(self, s: str) -> None:
        self._read(self._reader.feed(s))

    def _end(self) -> None:
        self._read(self._reader.finish())

    def _read(self, events: list) -> None:
        for event in events:
            header = event.header
            if header.recipient is not None:  # a call: passed on as markup
                if event.kind is EventKind.BEGIN:
                    raw = header.raw if header.raw.startswith("<|") else START + header.raw
                    self._answer(f"{raw}{MESSAGE}")
                elif event.kind is EventKind.END:
                    self._answer("<|call|>")
                else:
                    self._answer(event.text)
            elif event.kind is EventKind.TEXT:
                if header.channel == "analysis":
                    self._reason(event.text)
                else:
                    self._answer(event.text)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                        GptOssReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
