"""The pythonic parser: a Python list of calls, as Llama 3.2 and 4 write them."""

from __future__ import annotations

import ast
import json
from typing import Any

from server.api.tool_parsers._json import _CLOSER
from server.api.tool_parsers.base import ToolParser

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A literal's value (JSON-style true/false/null accepted); ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (str, int, float, bool, type(None)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:  # None: a **mapping
        pairs = zip(node.keys, node.values)
        return {_literal(k): _literal(v) for k, v in pairs}  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if type(value) in (int, float):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def _python_call(src: str) -> tuple[str, str] | None:
    """``name(key=literal, ...)`` -> (name, JSON arguments), or None."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        name = _dotted(node.func)
        args = {k.arg: _literal(k.value) for k in node.keywords}
        return (name, json.dumps(args, ensure_ascii=False, allow_nan=False)) if name else None
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    """A Python list of calls, ``[get_weather(city="Paris"), other()]`` (Llama 3.2/4); each
    call goes out whole once complete. Output that is not such a list is all content."""

    name = "pythonic"

    def __init__(self) -> None:
        super().__init__()
        self._elem = ""            # the call being read
        self._stack: list[str] = []
        self._quote = ""           # open string's quote, "\\" appended after a backslash

    def _step(self, s: str) -> str | None:
        st = self._state
        if st == "start":
            t = s.lstrip()
            self._pend += s[:len(s) - len(t)]
            if not t:
                return None
            if t[0] != "[":
                return self._give_up(t, "text")
            self._pend += "["
            self._state = "elem"
            s = t[1:]
        if self._state == "text":
            self._text(s)
            return None
        for j, ch in enumerate(s):
            self._pend += ch
            st = self._state
            if st == "body":
                self._elem += ch
                if self._quote:
                    self._quote = (self._quote[0] if len(self._quote) > 1 else
                                   "" if ch == self._quote else self._quote + "\\" * (ch == "\\"))
                elif ch in "\"'":
                    self._quote = ch
                elif ch in "([{":
                    self._stack.append(ch)
                elif ch in ")]}":
                    if _CLOSER.get(self._stack.pop(), ")") != ch:
                        return self._give_up(s[j + 1:], "text")
                    if not self._stack:
                        call = _python_call(self._elem)
                        if call is None:
                            return self._give_up(s[j + 1:], "text")
                        self._call(*call)
                        self._pend, self._elem, self._state = "", "", "next"
            elif ch.isspace():
                if st == "name" and self._elem:
                    self._state = "paren"
            elif st == "next" and ch == ",":
                self._state = "elem"
            elif ch == "]" and (st == "next" or (st == "elem" and self._ncalls)):
                self._pend, self._state = "", "text"  # the list is closed; what follows is text
                return s[j + 1:]
            elif st in ("elem", "name") and (ch.isalnum() or ch == "_" or ch == "." and self._elem):
                if not self._elem and not ch.isidentifier():
                    return self._give_up(s[j + 1:], "text")
                self._elem += ch
                self._state = "name"
            elif st in ("name", "paren") and ch == "(":
                self._elem += ch
                self._stack, self._state = ["("], "body"
            else:
                return self._give_up(s[j + 1:], "text")
        return None

    def _end(self) -> None:
        if self._state != "text":
            self._text(self._pend)
