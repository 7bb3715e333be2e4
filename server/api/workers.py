"""The preprocess pool: the one sized executor for API work whose cost grows with the input
(parsing big bodies, chat templates, tokenizing, detokenizing, logprobs and big answers).

The event loop only awaits it. One client may hold at most half of the workers (its further
jobs wait in its own queue, on the loop, costing nothing), so another client always finds a
free worker however much one client sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.engine.inputs import Offload

logger = logging.getLogger(__name__)
T = TypeVar("T")

# After a request that handled this much (body bytes, answer bytes), freed memory is handed
# back to the system: glibc keeps what worker threads freed in their own arenas otherwise.
BIG_REQUEST_BYTES = 1 << 20
_TRIM_DELAY_S = 0.2  # the request's own objects are gone once its response has been sent


@dataclass(eq=False)
class _Share:
    """One client's slots; dropped once the client has nothing queued or running."""

    slots: asyncio.Semaphore
    users: int = 0


@dataclass(eq=False)
class PreprocessPool:
    """``workers`` threads; ``run(client, fn, *args)`` runs ``fn`` on one of them."""

    workers: int
    _pool: ThreadPoolExecutor = field(init=False)
    _shares: dict[str, _Share] = field(init=False, default_factory=dict)
    _trim_pending: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("the preprocess pool needs at least one worker")
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="preprocess")

    @property
    def per_client(self) -> int:
        """Workers one client may occupy at once: half, so others always find one free."""
        return max(1, self.workers // 2)

    async def run(self, client: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker, after the client's earlier jobs beyond its share.
        Cancelling the caller cancels a job not yet started; a started one keeps its slot
        until it ends, so a client cannot exceed its share by disconnecting."""
        share = self._shares.get(client)
        if share is None:
            share = self._shares[client] = _Share(asyncio.Semaphore(self.per_client))
        share.users += 1
        try:
            await share.slots.acquire()
        except BaseException:
            self._leave(client, share)
            raise
        loop = asyncio.get_running_loop()
        try:
            job: Future[T] = self._pool.submit(fn, *args)
        except BaseException:
            share.slots.release()
            self._leave(client, share)
            raise

        def finished(_: Future[T]) -> None:  # on a worker, or on the loop when cancelled
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to free
                loop.call_soon_threadsafe(self._release, client, share)

        job.add_done_callback(finished)
        return await asyncio.wrap_future(job)

    def offload(self, client: str) -> Offload:
        """:meth:`run` in ``client``'s share, as the engine takes it (the engine builds and
        checks a request's prompt in one job there)."""
        async def run(fn: Callable[[], T]) -> T:
            return await self.run(client, fn)

        return run

    def _release(self, client: str, share: _Share) -> None:
        share.slots.release()
        self._leave(client, share)

    def _leave(self, client: str, share: _Share) -> None:
        share.users -= 1
        if share.users == 0 and self._shares.get(client) is share:
            del self._shares[client]

    def busy_clients(self) -> int:
        """Clients with work queued or running (for tests and debugging)."""
        return len(self._shares)

    def trim_soon(self) -> None:
        """Hands freed memory back to the system shortly (after a big request), at most one
        trim at a time; on the loop's thread."""
        if self._trim_pending or _MALLOC_TRIM is None:
            return
        self._trim_pending = True
        loop = asyncio.get_running_loop()

        def start() -> None:
            job = self._pool.submit(trim_memory)
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._trimmed))

        loop.call_later(_TRIM_DELAY_S, start)

    def _trimmed(self) -> None:
        self._trim_pending = False

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS): nothing to trim there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_MALLOC_TRIM = _malloc_trim()
_TRIM_LOCK = threading.Lock()


def trim_memory() -> None:
    """Returns the free memory of every malloc arena to the system (ctypes releases the GIL
    for the call, so it runs on a worker without stalling the loop)."""
    if _MALLOC_TRIM is None:
        return
    with _TRIM_LOCK:
        _MALLOC_TRIM(0)
