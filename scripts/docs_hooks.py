"""MkDocs hook: the flags reference in docs/serving.md is generated from ``hpu-serve serve``'s
parser, which is itself generated from the config dataclasses' fields. A new flag is
documented by its field alone (name, default, help); nothing is written twice."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- flags: serve -->"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").replace("%%", "%").split())


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return "-"
    if isinstance(value, (list, tuple)):
        return "`" + " ".join(map(str, value)) + "`" if value else "-"
    return f"`{getattr(value, 'value', value)}`"


def _names(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}` (positional)"
    return ", ".join(f"`{name}`" for name in action.option_strings)


def _what(action: argparse.Action) -> str:
    what = _cell(action.help or "")
    if action.choices and "{" not in what:
        choices = " / ".join(f"`{getattr(c, 'value', c)}`" for c in action.choices)
        what = f"{choices}: {what}" if what else choices
    return what


def flags_markdown() -> str:
    """One table per flag group of ``hpu-serve serve --help``, in its order."""
    from server.cli import build_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    lines: list[str] = []
    for group in serve._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = {"positional arguments": "model", "options": "engine and server"}.get(
            group.title or "", group.title or "")
        lines += [f"### {title[:1].upper()}{title[1:]}", "", "| flag | default | what |",
                  "|---|---|---|"]
        lines += [f"| {_names(a)} | {_default(a)} | {_what(a)} |" for a in actions]
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, flags_markdown())
    return markdown
