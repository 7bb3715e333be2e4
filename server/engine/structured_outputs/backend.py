"""Structured outputs: a grammar per request, a token mask per step (xgrammar).

A request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) is checked
against the size caps (``limits``), then compiled off the engine thread and off the
tokenization threads: first by a killable worker process under ``--grammar-compile-timeout``
(``compile_pool``), then, once known to end in time, by this process on a thread of its own
(``--grammar-workers`` of them, at a lower CPU priority). Compiled grammars are kept in an
LRU cache keyed by the constraint's text (``--grammar-cache-size`` entries, and at most
``CACHE_BYTES``), failures too: a client repeating a constraint that overran the limit
costs nothing the second time.

The async engine queues a request into the engine only once its grammar is ready
(``AsyncEngine.submit`` awaits :meth:`StructuredOutputs.compile_async`), rather than having
the scheduler skip not-ready requests: a request waiting for its grammar then holds no KV
block, no place in the scheduler's queues and no fair-share turn; the engine thread never
polls readiness each step; and a client that goes away meanwhile only cancels a future.
Its arrival time is kept, so the wait shows in its queue time.

Each sequence gets its own matcher. Every step the batch's matchers fill a
``[rows, ceil(vocab / 32)]`` bitmask (rows without a grammar: all ones), which the sampler
applies as plain tensor ops before anything else, so guided and unguided requests share
steps and the masked logprobs are what the client sees. Accepting each sampled token
advances the matcher; preemption keeps the tokens (recomputed, never discarded), so a
matcher never needs rolling back here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from server.config import StructuredOutputsConfig
from server.engine.errors import RequestError
from server.engine.sampling_params import StructuredOutputsParams
from server.engine.structured_outputs.compile_pool import CompileReport, CompileTimeout, GrammarPool
from server.engine.structured_outputs.compile_worker import compile_source
from server.engine.structured_outputs.limits import (
    GrammarSource,
    checked_source,
    client_message,
    source_of,
)

logger = logging.getLogger(__name__)

# The backends ``--structured-outputs-backend`` accepts ("auto" is xgrammar).
BACKENDS = ("auto", "xgrammar")
# Memory the cached grammars may hold together, whatever --grammar-cache-size says (the
# largest grammar within the default caps is ~8 MB compiled).
CACHE_BYTES = 512 << 20
# The server's own compile threads run below the engine thread, like the worker processes.
COMPILE_THREAD_NICENESS = 10


class GrammarState:
    """One sequence's matcher, plus what the engine needs to know about it."""

    def __init__(self, matcher: Any, start_after: str | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.matcher = matcher
        # the text after which the constraint starts (the end of a reasoning section, such
        # as "</think>"); None: from the first generated token
        self.start_after = start_after
        self._decode = decode
        self.active = start_after is None

    def observe(self, output_token_ids: list[int]) -> None:
        """Activates the constraint once the generated text reaches ``start_after``.

        Compared as text, not as token ids: a marker that is plain text for the tokenizer
        merges with its neighbours differently in context. Every token holds at least one
        character, so the last ``len(marker)`` tokens are enough to find it."""
        if self.active or self.start_after is None or self._decode is None:
            return
        tail = self._decode(output_token_ids[-len(self.start_after):])
        self.active = self.start_after in tail

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


@dataclass(frozen=True, slots=True)
class _Failure:
    """A cached failure: the message, without the field (the same text may come from
    another field next time)."""

    message: str


class GrammarCache:
    """LRU of compiled grammars (and failures) keyed by source, bounded in entries and bytes."""

    def __init__(self, max_entries: int, max_bytes: int = CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[GrammarSource, tuple[Any, int]] = (
            collections.OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, source: GrammarSource) -> bool:
        return source in self._items

    def get(self, source: GrammarSource) -> Any | None:
        with self._lock:
            item = self._items.get(source)
            if item is None:
                return None
            self._items.move_to_end(source)
            return item[0]

    def put(self, source: GrammarSource, value: Any, size: int) -> None:
        with self._lock:
            old = self._items.pop(source, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[source] = (value, size)
            self._bytes += size
            while len(self._items) > self.max_entries or (
                    self._bytes > self.max_bytes and len(self._items) > 1):
                _, (_, freed) = self._items.popitem(last=False)
                self._bytes -= freed


class StructuredOutputs:
    """The xgrammar backend of one model: its vocabulary, bounded compilation, a cache,
    masks. ``close()`` stops its worker processes."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int] | None = None,
                 config: StructuredOutputsConfig | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.config = config or StructuredOutputsConfig()
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=stop_token_ids)
        # No cache of its own (unbounded): GrammarCache is the one cache.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self.cache = GrammarCache(self.config.cache_size)
        self.pool = GrammarPool(self._info.serialize_json(), self.config.workers,
                                self.config.compile_timeout)
        self._threads = ThreadPoolExecutor(self.config.workers, "grammar-compile",
                                           initializer=_lower_thread_priority)
        # sources compiled by this process right now: identical requests share the work
        self._local: dict[GrammarSource, Future[Any]] = {}
        self._local_lock = threading.Lock()

    def close(self) -> None:
        self.pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def check(self, spec: StructuredOutputsParams) -> GrammarSource:
        """Raises :class:`RequestError` (naming the field and the flag) for a constraint
        beyond the caps or that does not parse; cheap next to compiling."""
        return checked_source(spec, self.config)

    def compile(self, spec: StructuredOutputsParams, client: str = "") -> Any:
        """The compiled grammar of ``spec``, blocking (the offline ``LLM``'s path)."""
        self.check(spec)
        return self.compile_async(spec, client).result()

    def compile_async(self, spec: StructuredOutputsParams, client: str = "") -> Future[Any]:
        """A future of ``spec``'s compiled grammar (call :meth:`check` first); it fails
        with a :class:`RequestError` naming ``spec.field``. Cancelling it while the grammar
        waits or compiles frees its worker (unless another request waits for the same)."""
        source = source_of(spec)
        result: Future[Any] = Future()
        cached = self.cache.get(source)
        if cached is not None:
            self._settle(result, cached, spec)
            return result
        probe = self.pool.submit(source, client)
        result.add_done_callback(lambda f: probe.cancel() if f.cancelled() else None)
        probe.add_done_callback(lambda p: self._after_probe(p, source, spec, result))
        return result

    def _after_probe(self, probe: Future[CompileReport], source: GrammarSource,
                     spec: StructuredOutputsParams, result: Future[Any]) -> None:
        """(in the pool's thread: never blocks)"""
        if probe.cancelled():
            result.cancel()
            return
        error = probe.exception()
        if error is not None:
            if isinstance(error, CompileTimeout):
                failure = _Failure(
                    f"the {source.kind} took more than {self.config.compile_timeout:g} s to "
                    "compile, the server's limit (--grammar-compile-timeout); simplify it")
            else:
                failure = _Failure(f"invalid {source.kind}: {client_message(error)}")
            self.cache.put(source, failure, len(failure.message))
            self._settle(result, failure, spec)
            return
        try:
            with self._local_lock:
                local = self._local.get(source)
                if local is None:
                    local = self._threads.submit(self._compile_here, source, probe.result())
                    self._local[source] = local
        except RuntimeError:  # closed: the server is shutting down
            self._settle(result, _Failure("the server is shutting down"), spec)
            return
        local.add_done_callback(lambda f: self._settle(result, _outcome(f, source), spec))

    def _compile_here(self, source: GrammarSource, report: CompileReport) -> Any:
        """This process's compilation of a source its worker compiled in time."""
        try:
            compiled = compile_source(self._compiler, source.kind.value, source.text)
            self.cache.put(source, compiled, int(compiled.memory_size_bytes))
            logger.debug("compiled a %s grammar: %.1f ms in its worker, %.1f MB", source.kind,
                         report.seconds * 1e3, report.memory_bytes / 1e6)
            return compiled
        finally:
            with self._local_lock:
                self._local.pop(source, None)

    @staticmethod
    def _settle(result: Future[Any], value: Any, spec: StructuredOutputsParams) -> None:
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            if isinstance(value, _Failure):
                result.set_exception(RequestError(f"{spec.field}: {value.message}", spec.field))
            else:
                result.set_result(value)

    def state(self, compiled: Any, start_after: str | None = None,
              decode: Callable[[list[int]], str] | None = None) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(compiled), start_after, decode)

    def bitmask(self, states: list[GrammarState | None]) -> torch.Tensor | None:
        """``[rows, words]`` int32 of allowed tokens, or None when no row is constrained
        (all ones where a row has no active grammar)."""
        if not any(s is not None and s.active and not s.terminated for s in states):
            return None
        mask = self._xgr.allocate_token_bitmask(len(states), self.vocab_size)
        for row, state in enumerate(states):
            if state is not None and state.active and not state.terminated:
                state.matcher.fill_next_token_bitmask(mask, row)
        return mask


def _outcome(local: Future[Any], source: GrammarSource) -> Any:
    if local.cancelled():
        return _Failure("the server is shutting down")
    error = local.exception()
    return local.result() if error is None else _Failure(
        f"invalid {source.kind}: {client_message(error)}")


def _lower_thread_priority() -> None:
    """Linux's nice applies per thread (to the calling thread's id)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_THREAD_NICENESS)
