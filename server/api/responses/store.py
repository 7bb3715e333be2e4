"""The bounded in-memory store of responses (``store``, ``previous_response_id``,
``GET /v1/responses/{id}``, background responses).

A response is kept while it is among the newest ``--responses-store-max-entries`` and younger
than ``--responses-store-ttl-s`` (counted from when it finished); a running background
response is never evicted (the engine's admission bounds how many run). An evicted id is
remembered (a bounded list of ids, no content) so that a client asking for it learns that it
was evicted and by which bound, rather than being told that it never existed.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.api.errors import APIError
from server.api.responses.protocol import ResponseObject
from server.config import ResponsesStoreConfig

# evicted ids remembered per stored entry allowed: beyond, the oldest is forgotten (then a
# client asking for it is told "not found", as for an id that never existed)
_TOMBSTONES_PER_ENTRY = 10


@dataclass(slots=True)
class StoredResponse:
    """One response and the conversation it continues (the chat messages of its input and
    output, without its instructions, which OpenAI does not carry over)."""

    response: ResponseObject
    conversation: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None  # a background response's generation
    finished_at: float | None = None


class ResponseStore:
    def __init__(self, config: ResponsesStoreConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()  # id -> why

    def put(self, entry: StoredResponse) -> None:
        if entry.response.status.finished and entry.finished_at is None:
            entry.finished_at = self._clock()
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        self._evict()

    def finished(self, entry: StoredResponse) -> None:
        """``entry``'s response has finished: its TTL starts now."""
        entry.finished_at = self._clock()
        self._evict()

    def get(self, response_id: str) -> StoredResponse:
        """The entry, or a 404 saying whether it was evicted or never existed."""
        self._evict()
        entry = self._entries.get(response_id)
        if entry is not None:
            return entry
        why = self._evicted.get(response_id)
        if why is not None:
            raise APIError(404, f"response {response_id} was evicted from the store ({why}; "
                                f"capacity {self._config.max_entries}, TTL "
                                f"{self._config.ttl_s:g} s: --responses-store-max-entries, "
                                "--responses-store-ttl-s)", "response_id", "response_evicted")
        raise APIError(404, f"Response with id '{response_id}' not found.", "response_id",
                       "response_not_found")

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self) -> None:
        now = self._clock()
        for rid, entry in list(self._entries.items()):
            if entry.finished_at is not None and now - entry.finished_at > self._config.ttl_s:
                self._forget(rid, "expired: older than the TTL")
        excess = len(self._entries) - self._config.max_entries
        for rid, entry in list(self._entries.items()):
            if excess <= 0:
                break
            if entry.response.status.finished:
                self._forget(rid, "the store was full")
                excess -= 1

    def _forget(self, response_id: str, why: str) -> None:
        del self._entries[response_id]
        self._evicted[response_id] = why
        while len(self._evicted) > self._config.max_entries * _TOMBSTONES_PER_ENTRY:
            self._evicted.popitem(last=False)
