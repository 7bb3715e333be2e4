"""What crosses between the event loop and the engine thread: the commands the loop queues
for the engine, and the stream each request's outputs come back through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Union

from server.engine.outputs import RequestOutput
from server.engine.request_state import RequestState


# Commands that cross into the engine thread.
@dataclass(frozen=True, slots=True)
class AddRequest:
    state: RequestState
    log_id: str | None = None  # the HTTP request's id, for lines logged while queueing it


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Ends every request now, each with a last output (finish_reason "abort")."""


@dataclass(frozen=True, slots=True)
class CallOnEngineThread:
    """Start-up work (load, warmup) that must run on the thread that will step."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Union[AddRequest, AbortRequest, AbortAll, CallOnEngineThread, Stop]


@dataclass(eq=False)
class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts the request."""

    request_id: str
    _abandon: Callable[[str], None]  # aborts the request in the engine
    _queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop's thread by the engine's deliveries."""
        self._queue.put_nowait(item)

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # the consumer went away (client disconnect, cancel)
                self._abandon(self.request_id)
