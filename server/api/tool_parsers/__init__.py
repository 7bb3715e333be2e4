"""Tool-call parsers: model output text -> OpenAI tool calls, whole or streamed.

Each parser is a state machine fed with pieces of text split anywhere; ``extract`` runs the
same machine over the whole output, so streamed and non-streamed results always agree. A JSON
call streams as the model writes it: its id and name go out once the name is complete and the
arguments object has begun, then the arguments text follows at *safe points* (prefixes that
closing brackets alone make valid JSON), so a call cut short still ends in valid arguments.
Text that might still become a tag is held back until it is decided.
"""

from __future__ import annotations

from server.api.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from server.api.tool_parsers.json_formats import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)
from server.api.tool_parsers.openai import OpenAIToolParser
from server.api.tool_parsers.pythonic import PythonicToolParser

__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
    "MistralToolParser", "OpenAIToolParser", "PythonicToolParser", "StreamDelta", "ToolCall", "ToolCallDelta",
    "ToolParser", "get_tool_parser", "new_call_id",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        OpenAIToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
