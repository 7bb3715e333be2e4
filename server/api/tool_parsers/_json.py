"""Incremental JSON scanning for tool calls: a character-level scanner, the streaming of an
arguments object up to its last safe point, and a whole ``{"name", "arguments"}`` call."""

from __future__ import annotations

import json
import re
import string
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.api.tool_parsers.base import ToolParser

(_VAL, _KEY0, _KEY, _KSTR, _COLON, _ARR0, _STR, _ESC, _HEX, _NUM, _LIT, _NEXT, _DONE) = range(13)
_SAFE = frozenset((_KEY0, _ARR0, _STR, _NEXT, _DONE))
_NUM_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITS = {"t": "rue", "f": "alse", "n": "ull"}
_CTRL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_ARG_KEYS = ("arguments", "parameters")
_CLOSER = {"{": "}", "[": "]"}


class _Json:
    """Scans one JSON value a character at a time (strings may hold raw control characters).

    For members of the outermost object it reports ``kspan`` (a key's span just closed) and
    ``ended`` (a value's span just closed), as offsets into the characters pushed."""

    __slots__ = ("stack", "state", "esc_of", "left", "num", "lit", "pos", "kstart", "kspan",
                 "vstart", "ended")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.state, self.esc_of, self.left, self.num, self.lit = _VAL, _STR, 0, "", ""
        self.pos = self.kstart = self.vstart = -1
        self.kspan: tuple[int, int] | None = None
        self.ended: tuple[int, int] | None = None

    def safe(self) -> bool:
        return self.state in _SAFE or (self.state == _NUM and bool(_NUM_RE.fullmatch(self.num)))

    def _close(self, end: int) -> None:
        if not self.stack:
            self.state = _DONE
            return
        self.state = _NEXT
        if len(self.stack) == 1:
            self.ended = (self.vstart, end)

    def push(self, ch: str) -> bool:
        """Consume ``ch``; False (nothing consumed) when it cannot continue the value."""
        st = self.state
        if st == _STR or st == _KSTR:
            if ch == '"':
                if st == _STR:
                    self._close(self.pos + 2)
                else:
                    self.state = _COLON
                    if len(self.stack) == 1:
                        self.kspan = (self.kstart, self.pos + 2)
            elif ch == "\\":
                self.esc_of, self.state = st, _ESC
        elif st == _ESC:
            if ch == "u":
                self.state, self.left = _HEX, 4
            elif ch in '"\\/bfnrt':
                self.state = self.esc_of
            else:
                return False
        elif st == _HEX:
            if ch not in string.hexdigits:
                return False
            self.left -= 1
            if not self.left:
                self.state = self.esc_of
        elif st == _LIT:
            if ch != self.lit[0]:
                return False
            self.lit = self.lit[1:]
            if not self.lit:
                self._close(self.pos + 2)
        elif st == _NUM and ch in "0123456789+-.eE":
            self.num += ch
        else:
            if st == _NUM:  # the number ends before ch
                if not _NUM_RE.fullmatch(self.num):
                    return False
                self._close(self.pos + 1)
                st = self.state
            if ch in " \t\n\r":
                if st == _DONE:
                    return False
            elif not self._structural(st, ch):
                return False
        self.pos += 1
        return True

    def _structural(self, st: int, ch: str) -> bool:
        pos = self.pos + 1
        if st == _VAL or (st == _ARR0 and ch != "]"):
            if len(self.stack) == 1:
                self.vstart = pos
            if ch == "{" or ch == "[":
                self.stack.append(ch)
                self.state = _KEY0 if ch == "{" else _ARR0
            elif ch == '"':
                self.state = _STR
            elif ch == "-" or "0" <= ch <= "9":
                self.state, self.num = _NUM, ch
            elif ch in _LITS:
                self.state, self.lit = _LIT, _LITS[ch]
            else:
                return False
        elif (st == _KEY0 or st == _KEY) and ch == '"':
            self.state, self.kstart = _KSTR, pos
        elif st == _COLON and ch == ":":
            self.state = _VAL
        elif st == _NEXT and ch == ",":
            self.state = _KEY if self.stack[-1] == "{" else _VAL
        elif ch in "}]" and self.stack and ch == _CLOSER[self.stack[-1]] and (
                st == _NEXT or st == (_KEY0 if ch == "}" else _ARR0)):
            self.stack.pop()
            self._close(pos + 1)
        else:
            return False
        return True


def _loads(text: str) -> Any:
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return None


class _Args:
    """Streams an arguments object's text as ``scan`` consumes it, up to its last safe point."""

    __slots__ = ("p", "index", "scan", "depth", "out", "safe", "safe_str", "sent")

    def __init__(self, p: ToolParser, index: int, scan: _Json, depth: int) -> None:
        self.p, self.index, self.scan, self.depth = p, index, scan, depth
        self.out: list[str] = []
        self.safe = self.sent = 0
        self.safe_str = False

    def add(self, ch: str, was: int) -> None:
        scan = self.scan
        if ch < " " and was in (_STR, _KSTR) and scan.state == was:
            ch = _CTRL.get(ch) or f"\\u{ord(ch):04x}"  # keep the text strict JSON
        self.out.append(ch)
        if scan.safe():
            self.safe, self.safe_str = len(self.out), scan.state == _STR
            self.p._args(self.index, "".join(self.out[self.sent:self.safe]))
            self.sent = self.safe

    def close(self) -> None:
        """Cut short: close what the last safe point left open."""
        inner = reversed(self.scan.stack[self.depth:])
        self.p._args(self.index, '"' * self.safe_str + "".join(_CLOSER[c] for c in inner))


def _whole_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object, or None when it is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in _ARG_KEYS if k in obj), None)
    if isinstance(args, str):  # arguments given as JSON text
        args = _loads(args) if args.strip() else {}
    elif args is None:
        args = {}
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class _Call:
    """One ``{"name": ..., "arguments": {...}}`` object. ``push`` -> 1 complete, -1 error."""

    __slots__ = ("p", "scan", "raw", "key", "name", "args", "args_done")

    def __init__(self, p: ToolParser) -> None:
        self.p, self.scan, self.raw = p, _Json(), []
        self.key: Any = None
        self.name: str | None = None
        self.args: _Args | None = None
        self.args_done = False

    def push(self, ch: str) -> int:
        scan = self.scan
        was = scan.state
        if not scan.push(ch):
            return -1
        self.raw.append(ch)
        if scan.kspan:
            self.key = _loads("".join(self.raw[scan.kspan[0]:scan.kspan[1]]))
            scan.kspan = None
        if self.args is not None and not self.args_done:
            self.args.add(ch, was)
            self.args_done = scan.ended is not None
        elif (ch == "{" and scan.vstart == scan.pos and self.key in _ARG_KEYS and self.name
              and self.args is None):
            self.args = _Args(self.p, self.p._call(self.name), scan, 1)
            self.args.add(ch, was)
        if scan.ended:
            if self.key == "name" and self.name is None:
                value = _loads("".join(self.raw[scan.ended[0]:scan.ended[1]]))
                self.name = value if isinstance(value, str) else None
            scan.ended = None
        return 1 if scan.state == _DONE else 0

    def end(self) -> bool:
        """The object is complete: False when it is no call (nothing was sent)."""
        if self.args is not None:
            return True
        call = _whole_call(_loads("".join(self.raw)))
        if call is not None:
            self.p._call(*call)
        return call is not None

    def close(self) -> bool:
        """Cut short or broken: finish the call if it was started; False if it was not."""
        if self.args is not None and not self.args_done:
            self.args.close()
        return self.args is not None
