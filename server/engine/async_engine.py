"""Async front of the engine: the model runs on its own thread, asyncio never blocks on it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from server.config import EngineConfig
from server.engine.errors import EngineDeadError, RequestError, RequestFailedError
from server.engine.llm_engine import EngineStats, LLMEngine
from server.engine.outputs import RequestOutput
from server.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts the request."""

    request_id: str
    _engine: AsyncEngine
    _queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

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
                self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs ``LLMEngine.step()`` in a background thread and fans outputs out to streams.

    Commands (add / abort) cross into the engine thread through a queue; outputs come back
    with ``loop.call_soon_threadsafe``. Tokenization and validation run in a worker thread
    too, so a long prompt never stalls the event loop.

    Every tensor operation (load, warmup, steps) runs on that one thread: each thread that
    calls into torch gets its own OpenMP team, and a second team left over from loading on
    the main thread made decode steps ~1.5x slower on a 2-core machine (measured).
    """

    def __init__(self, engine_factory: Callable[[], LLMEngine],
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        # Called (from the engine thread) once the loop has died: the server uses it to
        # stop and exit non-zero, so an orchestrator restarts it instead of a zombie 503.
        self.on_dead = on_dead
        self._commands: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead_reason: BaseException | None = None
        self.engine: LLMEngine | None = None
        # Requests accepted by submit() that the engine thread has not queued yet. They are
        # waiting as far as a client can tell: without them a burst arriving between two
        # engine steps would all pass a --max-waiting-requests check.
        self._in_transit = 0
        self._in_transit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self.engine = self.call(engine_factory)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(lambda: LLMEngine(config))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the engine thread and returns its result (blocking); for
        start-up work such as warmup, before requests flow."""
        future: Future[T] = Future()
        self._commands.put(("call", (fn, args, future)))
        return future.result()

    @property
    def tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.engine.tokenizer

    @property
    def metrics_registry(self):  # noqa: ANN201 - prometheus CollectorRegistry
        """The device layer's counters (compilations, bucket misses...), for /metrics."""
        return self.engine.counters.registry

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._loop is not None and self._thread.is_alive()

    def start(self) -> None:
        """Binds to the running event loop: from now on outputs flow to request streams."""
        self._loop = asyncio.get_running_loop()

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("stop", None))
        await asyncio.to_thread(self._thread.join, 30)

    async def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> RequestStream:
        """Validates (raising RequestError) and queues a request; iterate the result."""
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.dead_reason!r}")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        self._transit(+1)
        try:
            state = await asyncio.to_thread(self.engine.prepare, request_id, prompt, params)
        except BaseException:
            self._transit(-1)
            raise
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self._commands.put(("add", state))
        return stream

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks (no-op if it already finished)."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine's snapshot, with requests still on their way in counted as waiting
        (read first: one crossing over meanwhile is counted twice, never missed)."""
        in_transit = self._in_transit
        stats = self.engine.stats()
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + in_transit)

    def _transit(self, delta: int) -> None:
        with self._in_transit_lock:
            self._in_transit += delta

    def _busy(self) -> bool:
        return self.engine is not None and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self._busy())
                if self._busy():
                    outputs = self.engine.step()  # type: ignore[union-attr]
                    if outputs:
                        self._deliver(outputs)
        except BaseException as exc:  # the loop must report, not vanish
            logger.exception("engine loop died")
            self.dead_reason = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))
            if self.on_dead is not None:
                self.on_dead(exc)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self.engine.abort_request(str(payload))  # type: ignore[union-attr]
            elif kind == "call":
                fn, args, future = payload  # type: ignore[misc]
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller re-raises it; the loop goes on
                    future.set_exception(exc)

    def _add(self, state: object) -> None:
        request_id = state.request_id  # type: ignore[attr-defined]
        try:
            self.engine.enqueue(state)  # type: ignore[arg-type, union-attr]
        except RequestError as exc:
            self._call_loop(self._push_error, request_id, exc)
        except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the loop
            logger.exception("request %s could not be queued", request_id)
            self.engine.abort_request(request_id)  # type: ignore[union-attr]
            self._call_loop(self._push_error, request_id,
                            RequestFailedError(request_id, f"{type(exc).__name__}: {exc}"))
        finally:
            self._transit(-1)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._call_loop(self._push_outputs, outputs)

    def _call_loop(self, fn, *args) -> None:  # noqa: ANN001
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _push_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                self._push_error(out.request_id, RequestFailedError(out.request_id, out.error))
                continue
            stream._queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    def _push_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._queue.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        def fail() -> None:
            for request_id in list(self._streams):
                self._push_error(request_id, exc)

        self._call_loop(fail)
