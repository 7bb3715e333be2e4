"""Streaming text against markers (``<tool_call>``, ``</think>``...): how much of a buffer's
end could still become a marker, and so must be held back."""

from __future__ import annotations


def partial_marker(buf: str, marker: str) -> int:
    """Length of the longest end of ``buf`` that starts ``marker`` (short of all of it)."""
    at = buf.find(marker[0], max(0, len(buf) - len(marker) + 1))
    while at >= 0:
        if marker.startswith(buf[at:]):
            return len(buf) - at
        at = buf.find(marker[0], at + 1)
    return 0
