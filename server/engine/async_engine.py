"""Async front of the engine: the model runs on its own thread, asyncio never blocks on it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from server.config import EngineConfig
from server.engine.engine_commands import (
    AbortAll,
    AbortRequest,
    AddRequest,
    CallOnEngineThread,
    Command,
    RequestStream,
    Stop,
)
from server.engine.errors import (
    EngineDeadError,
    EngineSleepingError,
    RequestError,
    RequestFailedError,
)
from server.engine.inputs import Offload, PromptBuilder, PromptInput
from server.engine.llm_engine import LLMEngine
from server.engine.lora.request import LoRARequest
from server.engine.multimodal.inputs import VisionInfo
from server.engine.outputs import EngineStats, RequestOutput
from server.engine.pooling.engine import PoolingEngine
from server.engine.pooling.params import PoolingModelInfo
from server.engine.request_state import RequestState
from server.engine.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from server.engine.sampling_params import SamplingParams
from server.engine.sleep import ALL_TAGS, SleepLevel, WakeTag
from server.engine.stats_log import StatsLog
from server.engine.tokenizer import Tokenizer
from server.log import current_request_id, request_context

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """Runs ``LLMEngine.step()`` in a background thread and fans outputs out to streams.

    Commands (add / abort / call / stop) cross into the engine thread through a queue;
    outputs come back with ``loop.call_soon_threadsafe``. Building a prompt (a chat template),
    tokenizing and validating it run as one job on a worker thread, so a long prompt never
    stalls the event loop.

    Every tensor operation (load, warmup, steps) runs on that one thread: each thread that
    calls into torch gets its own OpenMP team, and a second team left over from loading on
    the main thread made decode steps ~1.5x slower on a 2-core machine (measured).
    """

    def __init__(self, engine_factory: Callable[[Callable[[BaseException], None]], LLMEngine],
                 on_dead: Callable[[BaseException], None] | None = None,
                 stats_interval: float | None = None) -> None:
        # Called (from the engine thread) once the loop has died: the server uses it to
        # stop and exit non-zero, so an orchestrator restarts it instead of a zombie 503.
        self._on_dead = on_dead
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead_reason: BaseException | None = None
        self._engine: LLMEngine | None = None
        # Requests accepted by submit() that the engine thread has not queued yet. They are
        # waiting as far as a client can tell: without them a burst arriving between two
        # engine steps would all pass a --max-waiting-requests check.
        self._in_transit = 0
        self._in_transit_lock = threading.Lock()
        # When the engine thread last went round its loop (a step finished, or an idle wait
        # of at most 0.5 s ended): /health reads it to tell a stuck engine from a busy one.
        self._heartbeat = time.monotonic()
        # /sleep refuses new requests from its first moment, before the engine thread gets
        # to it; one sleep / wake / reload at a time (made on the loop in start())
        self._sleeping = False
        self._sleep_lock: asyncio.Lock | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        # the factory gets the engine's fault listener: a worker rank's death comes here
        self._engine = self.call(engine_factory, self._fault)
        # the periodic stats line (None: --disable-log-stats), a task on the loop
        self._stats_log = None if stats_interval is None else StatsLog(
            stats_interval, self.stats, self._engine.counters)
        self._stats_task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig,
                    on_dead: Callable[[BaseException], None] | None = None,
                    stats_interval: float | None = None) -> AsyncEngine:
        from server.engine.pooling.select import build_engine  # --runner picks the core

        return cls(functools.partial(build_engine, config), on_dead, stats_interval)

    @property
    def engine(self) -> LLMEngine:
        """The engine core (touch it from the engine thread only, e.g. through ``call``)."""
        assert self._engine is not None, "the engine is still being built"
        return self._engine

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the engine thread and returns its result (blocking); for
        start-up work such as warmup, before requests flow."""
        future: Future[T] = Future()
        self._commands.put(CallOnEngineThread(fn, args, future))
        return future.result()

    async def reset_prefix_cache(self) -> int:
        """Drops every cached prefix, on the engine thread between steps."""
        future: Future[int] = Future()
        self._commands.put(CallOnEngineThread(self.engine.reset_prefix_cache, (), future))
        return await asyncio.wrap_future(future)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Reads and checks an adapter on a worker thread (a slow disk or a large adapter
        never holds up the running streams; the step that first needs it copies it into a
        slot) and serves it under ``name`` from then on; a RequestError names what is
        wrong."""
        request = self.engine.loras.new_request(name, path)
        await asyncio.to_thread(self.engine.add_lora, request)
        self.engine.loras.add(request)
        return request

    async def unload_lora_adapter(self, name: str) -> None:
        """Stops serving ``name`` (LoRANotFoundError if unknown); requests already queued
        with it finish."""
        request = self.engine.loras.remove(name)
        await self._on_engine(self.engine.remove_lora, request.lora_int_id)

    @property
    def runtime_lora_updating(self) -> bool:
        """VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
        are served."""
        engine = self.engine  # the pooling runner serves no adapters
        return (not isinstance(engine, PoolingEngine)
                and engine.lora_config.allow_runtime_lora_updating)

    def lora_adapters(self) -> list[LoRARequest]:
        engine = self.engine
        return [] if isinstance(engine, PoolingEngine) else engine.loras.all()

    def lora_adapter(self, name: str) -> LoRARequest | None:
        engine = self.engine
        return None if isinstance(engine, PoolingEngine) else engine.loras.get(name)

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the engine thread between steps, awaited without blocking."""
        future: Future[T] = Future()
        self._commands.put(CallOnEngineThread(fn, args, future))
        return await asyncio.wrap_future(future)

    @property
    def sleep_mode_enabled(self) -> bool:
        """``--enable-sleep-mode``: the admin endpoints exist."""
        return self.engine.sleep_mode

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    async def sleep(self, level: SleepLevel) -> int:
        """Refuses new requests at once (EngineSleepingError), aborts the running ones (each
        stream gets its last output, finish_reason "abort"), then frees memory on the engine
        thread. Returns how many requests were aborted."""
        assert self._sleep_lock is not None, "start() first"
        async with self._sleep_lock:
            was_sleeping, self._sleeping = self._sleeping, True
            try:
                ended = await self._on_engine(self.engine.sleep, level)
            except BaseException:
                self._sleeping = was_sleeping
                raise
            self._push_outputs(ended)
            return len(ended)

    async def wake_up(self, tags: frozenset[WakeTag] = ALL_TAGS) -> bool:
        """Restores what ``tags`` name; requests are served again once nothing is left
        asleep. Returns whether the engine still sleeps."""
        assert self._sleep_lock is not None, "start() first"
        async with self._sleep_lock:
            await self._on_engine(self.engine.wake_up, tags)
            self._sleeping = self.engine.is_sleeping
            return self._sleeping

    async def reload_weights(self, path: str) -> None:
        """Swaps in the weights at ``path`` between steps (RequestError if they differ)."""
        assert self._sleep_lock is not None, "start() first"
        async with self._sleep_lock:
            await self._on_engine(self.engine.reload_weights, path)

    def observed_shapes(self) -> dict[str, Any]:
        """Step shapes seen and per-bucket warmup cost (a lock-guarded copy: no need to wait
        for the engine thread)."""
        return self.engine.counters.observed.snapshot()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def pooling(self) -> PoolingModelInfo | None:
        """The served pooling model (``--runner pooling``); None for a generative one."""
        engine = self.engine
        return engine.info if isinstance(engine, PoolingEngine) else None

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        engine = self.engine  # a pooling model samples nothing: no generation defaults
        return NO_DEFAULTS if isinstance(engine, PoolingEngine) else engine.sampling_defaults

    @property
    def vision(self) -> VisionInfo | None:
        """A vision-language model's image rules; None for a text-only or pooling model."""
        engine = self.engine
        return None if isinstance(engine, PoolingEngine) else engine.vision

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The device layer's counters (compilations, bucket misses...), for /metrics."""
        return self.engine.counters.registry

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._loop is not None and self._thread.is_alive()

    def start(self) -> None:
        """Binds to the running event loop: from now on outputs flow to request streams."""
        self._loop = asyncio.get_running_loop()
        if self._stats_log is not None:
            self._stats_task = self._loop.create_task(self._stats_log.run())
        self._sleep_lock = asyncio.Lock()

    async def shutdown(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        self._stopping = True
        self._commands.put(Stop())
        await asyncio.to_thread(self._thread.join, 30)
        if self._engine is not None:  # stop the other ranks too: with orders only if the
            # loop has ended (a stuck loop may be inside a collective)
            await asyncio.to_thread(self._engine.shutdown, not self._thread.is_alive())

    def _fault(self, exc: BaseException) -> None:
        """A part of the engine outside its thread died (a tensor-parallel worker): the
        engine is dead now, whatever its loop is doing (from the executor's monitor)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = exc
        self._stopping = True
        self._commands.put(Stop())
        self._fail_all(EngineDeadError(f"engine died: {exc!r}"))
        if self._on_dead is not None:
            self._on_dead(exc)

    async def submit(
        self, request_id: str, prompt: str | list[int] | PromptBuilder,
        params: SamplingParams | None = None, client: str = "", offload: Offload | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validates (raising RequestError) and queues a request; iterate the result.

        ``prompt``: text or token ids with ``params``, or a builder of both (a chat template
        to render). Building, tokenizing and validating are one job run by ``offload`` (the
        API's preprocess pool; a thread of asyncio's own by default): a request crosses to a
        worker thread once. ``client``: who sent it, for fair admission (``--fair-share``)
        and the grammar compile pool's turns."""
        if callable(prompt) and params is not None:
            raise TypeError("a prompt builder brings its own params")
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.dead_reason!r}")
        if self._sleeping:
            raise EngineSleepingError("the engine is sleeping (POST /wake_up to resume)")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        # Claimed before the first await: a second submit with the same id is refused above
        # instead of replacing this stream while this one is still being built.
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        arrival = time.monotonic()  # before building: requests are built concurrently
        build = prompt if callable(prompt) else _given(prompt, params)

        def prepare() -> RequestState:  # on a worker thread
            given = build()
            images = {"images": given.images} if given.images else {}
            return self.engine.prepare(request_id, given.prompt, given.params, arrival,
                                       client, grammar=False, lora_request=lora_request,
                                       **images)

        self._transit(+1)
        try:
            state = await (offload or asyncio.to_thread)(prepare)
            await self._grammar(state, client)
        except BaseException:
            self._transit(-1)
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        if self._streams.get(request_id) is not stream:  # aborted meanwhile (shutdown)
            self._transit(-1)
            raise RequestError("the request was aborted before it was queued", "request_id")
        self._commands.put(AddRequest(state, current_request_id()))
        return stream

    async def _grammar(self, state: RequestState, client: str) -> None:
        """Compiles the request's constraint in the grammar pool and waits for it holding
        no thread: the request is queued into the engine once its grammar is ready (see
        ``structured_outputs``). A client that goes away cancels the compilation."""
        future = self.engine.input_processor.start_grammar(state, client)
        if future is None:
            return
        try:
            compiled = await asyncio.wrap_future(future)
        finally:
            future.cancel()  # no-op once done; frees the worker if this task was cancelled
        self.engine.input_processor.attach_grammar(state, compiled)

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks (no-op if it already finished)."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        """Ends every running or waiting request; unlike a client's abort, each stream
        still receives its last output (finish_reason "abort"). Thread-safe (the server
        calls it at the shutdown drain deadline)."""
        self._commands.put(AbortAll())

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
        return self._engine is not None and self._engine.has_unfinished_requests()

    def stalled_for(self) -> float:
        """Seconds since the engine thread last made progress while requests are in flight;
        0.0 when it is idle or keeping up (its loop comes round every step, and at least
        every 0.5 s when idle)."""
        if not self._streams and not self._in_transit:
            return 0.0
        return max(0.0, time.monotonic() - self._heartbeat)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain(block=not self._busy())
                self._heartbeat = time.monotonic()
                if self._busy():
                    outputs = self.engine.step()
                    self._heartbeat = time.monotonic()
                    if outputs:
                        self._call_loop(self._push_outputs, outputs)
        except BaseException as exc:  # the loop must report, not vanish
            logger.exception("engine loop died")
            self.dead_reason = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))
            if self._on_dead is not None:
                self._on_dead(exc)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(command, AddRequest):
                with request_context(command.log_id):
                    self._add(command.state)
            elif isinstance(command, AbortRequest):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, AbortAll):
                ended = [self.engine.abort_request(r) for r in self.engine.request_ids()]
                self._call_loop(self._push_outputs, [out for out in ended if out is not None])
            elif isinstance(command, CallOnEngineThread):
                try:
                    command.future.set_result(command.fn(*command.args))
                except BaseException as exc:  # the caller re-raises it; the loop goes on
                    command.future.set_exception(exc)

    def _add(self, state: RequestState) -> None:
        request_id = state.request_id
        try:
            self.engine.enqueue(state)
        except (RequestError, EngineSleepingError) as exc:  # asleep: queued while in transit
            self._call_loop(self._push_error, request_id, exc)
        except Exception as exc:  # noqa: BLE001 - one request's fault must not stop the loop
            logger.exception("request %s could not be queued", request_id)
            self.engine.abort_request(request_id)
            self._call_loop(self._push_error, request_id,
                            RequestFailedError(request_id, f"{type(exc).__name__}: {exc}"))
        finally:
            self._transit(-1)

    def _call_loop(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _push_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._stats_log is not None:
            self._stats_log.count(outputs)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                self._push_error(out.request_id, RequestFailedError(out.request_id, out.error))
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _push_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        def fail() -> None:
            for request_id in list(self._streams):
                self._push_error(request_id, exc)

        self._call_loop(fail)


def _given(prompt: str | list[int], params: SamplingParams | None) -> PromptBuilder:
    """The builder of a prompt that needs none."""
    given = PromptInput(prompt, params or SamplingParams())
    return lambda: given
