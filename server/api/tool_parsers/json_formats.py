"""Parsers of JSON tool calls: hermes, llama3_json and mistral."""

from __future__ import annotations

from typing import Any

from server.api.tool_parsers._json import _DONE, _Args, _Call, _Json
from server.api.tool_parsers.base import _ALNUM, ToolParser, _rng


class _JsonCallParser(ToolParser):
    """A parser whose calls are JSON objects read by ``_Call``."""

    def __init__(self) -> None:
        super().__init__()
        self._obj: Any = None  # the _Call (or mistral's _Args) being read

    def _json_call(self, s: str, done: str, cut: str, none: str) -> str | None:
        """Feed the call object ``self._obj``; at its end go to state ``done``, or ``cut`` when
        a started call breaks, or ``none`` (its text becoming content) when it is no call."""
        obj = self._obj
        assert obj is not None
        for j, ch in enumerate(s):
            r = obj.push(ch)
            if r == 0:
                continue
            if r == 1 and obj.end():
                self._pend, self._state = "", done
                return s[j + 1:]
            if r < 0 and obj.close():
                self._pend, self._state = "", cut
                return s[j:]
            self._pend += "".join(obj.raw)
            return self._give_up(s[j + (r == 1):], none)
        return None

    def _end_call(self) -> None:
        if self._obj is not None and not self._obj.close():
            self._text(self._pend + "".join(self._obj.raw))

    def _skip_ws(self, s: str) -> str:
        rest = s.lstrip()
        self._pend += s[:len(s) - len(rest)]
        return rest


class HermesToolParser(_JsonCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them.

    The call ends where its JSON object ends (a ``</tool_call>`` inside a string is text); the
    closing tag may be missing. Text around the calls is content. A block that is no call
    (bad JSON, no name) stays content; a call that breaks after its name went out keeps the
    arguments up to the last safe point, and the rest of its block is dropped."""

    name = "hermes"
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _step(self, s: str) -> str | None:
        st = self._state
        if st in ("start", "out"):
            rest = self._until(s, self.OPEN, self._text)
            if rest is not None:
                self._pend, self._state = self.OPEN, "open"
            return rest
        if st == "open":  # whitespace, then the object
            s = self._skip_ws(s)
            if not s:
                return None
            if s[0] != "{":
                return self._give_up(s, "out")
            self._obj, self._state = _Call(self), "json"
        if self._state == "json":
            return self._json_call(s, "after", "skip", "out")
        if st == "after":  # whitespace and the closing tag are dropped; anything else is text
            buf = self._hold + s
            t = buf.lstrip()
            if t.startswith(self.CLOSE):
                self._hold, self._state = "", "out"
                return t[len(self.CLOSE):]
            if self.CLOSE.startswith(t):
                self._hold = buf
                return None
            self._hold, self._state = "", "out"
            return buf
        rest = self._until(s, self.CLOSE, lambda _: None)  # "skip": the rest of a broken call
        if rest is not None:
            self._state = "out"
        return rest

    def _end(self) -> None:
        if self._state in ("start", "out"):
            self._text(self._hold)
        elif self._state == "open":
            self._text(self._pend)
        elif self._state == "json":
            self._end_call()


class Llama3JsonToolParser(_JsonCallParser):
    """``<|python_tag|>`` (optional), then ``{"name": ..., "parameters": {...}}`` objects
    (or ``"arguments"``) separated by ``;``. Output that does not start with an object, or
    whose first object is no call, is all content; text after the calls is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _step(self, s: str) -> str | None:
        st = self._state
        if st == "start":
            buf = self._hold + s
            t = buf.lstrip()
            if t.startswith(self.TAG):
                self._hold, self._state = "", "open"
                self._pend = buf[:len(buf) - len(t) + len(self.TAG)]
                return t[len(self.TAG):]
            if self.TAG.startswith(t):
                self._hold = buf
                return None
            self._hold, self._state = "", "open"
            return buf
        if st == "open":  # whitespace, then an object
            s = self._skip_ws(s)
            if not s:
                return None
            if s[0] != "{":
                return self._give_up(s, "text")
            self._obj, self._state = _Call(self), "json"
        if self._state == "json":
            return self._json_call(s, "sep", "text", "text")
        if st == "sep":  # whitespace, an optional ';', whitespace, the next object
            buf = self._hold + s
            t = buf.lstrip()
            if t.startswith(";"):
                t = t[1:].lstrip()
            if not t:
                self._hold = buf
                return None
            self._hold = ""
            if t[0] == "{":
                self._pend, self._state = buf[:len(buf) - len(t)], "open"
                return t
            self._state = "text"
            return buf
        self._text(s)  # "text"
        return None

    def _end(self) -> None:
        if self._state == "start":
            self._text(self._hold)
        elif self._state == "open":
            self._text(self._pend)
        elif self._state == "json":
            self._end_call()


class MistralToolParser(_JsonCallParser):
    """``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects, or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` (repeated). Text before and after is content; call ids are
    9 alphanumerics, as Mistral's templates expect."""

    name = "mistral"
    keeps_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._name_at = 0

    def _new_id(self) -> str:
        return "".join(_rng.choices(_ALNUM, k=9))

    def _step(self, s: str) -> str | None:
        st = self._state
        if st in ("start", "out"):
            rest = self._until(s, self.TAG, self._text)
            if rest is not None:
                self._pend, self._state = self.TAG, "tag"
            return rest
        if st in ("tag", "args0", "elem", "next"):
            s = self._skip_ws(s)
            if not s:
                return None
            if st == "tag":
                self._state = "elem" if s[0] == "[" else "name"
                if s[0] == "[":
                    self._pend += "["
                    return s[1:]
                self._name_at = len(self._pend)
                return s
            if st == "next":  # after a call in the array
                if s[0] == ",":
                    self._pend, self._state = "", "elem"
                    return s[1:]
                self._pend, self._state = "", "out"
                return s[1:] if s[0] == "]" else s
            if st == "elem" and s[0] == "]":  # an empty array
                self._pend, self._state = "", "out"
                return s[1:]
            if s[0] != "{":
                return self._give_up(s, "out")
            if st == "elem":
                self._obj, self._state = _Call(self), "json"
                return s
            scan = _Json()  # "args0": the arguments object of a named call
            self._obj = _Args(self, self._call(self._pend[self._name_at:-len(self.ARGS)]), scan, 0)
            self._pend, self._state = "", "args"
        if self._state == "json":
            return self._json_call(s, "next", "out", "out")
        if self._state == "args":
            args: _Args = self._obj
            for j, ch in enumerate(s):
                was = args.scan.state
                if not args.scan.push(ch):
                    args.close()
                    self._state = "out"
                    return s[j:]
                args.add(ch, was)
                if args.scan.state == _DONE:
                    self._state = "out"
                    return s[j + 1:]
            return None
        for j, ch in enumerate(s):  # "name", up to [ARGS]
            self._pend += ch
            name = self._pend[self._name_at:]
            k = name.find("[")
            if k < 0 and (ch.isalnum() or ch in "_-."):
                continue
            if name.endswith(self.ARGS) and k == len(name) - len(self.ARGS) and k:
                self._state = "args0"
                return s[j + 1:]
            if k < 0 or not self.ARGS.startswith(name[k:]) or not k:
                self._pend = self._pend[:-1]
                return self._give_up(s[j:], "out")
        return None

    def _end(self) -> None:
        if self._state in ("start", "out"):
            self._text(self._hold)
        elif self._state == "args":
            self._obj.close()
        elif self._state == "json":
            self._end_call()
        elif self._state != "next":
            self._text(self._pend)
