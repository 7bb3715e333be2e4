"""The periodic stats line (vLLM's, plus this project's compile and bucket-miss counters).

Every ``VLLM_LOG_STATS_INTERVAL`` seconds (10) while the server is busy, one line: prompt and
generation throughput over the interval, running and waiting requests, KV cache usage,
prefix-cache hit rate, preemptions, serving compilations and bucket misses. An idle server
writes nothing: a line is due only when tokens flowed or a figure changed since the last.

It runs as a task on the event loop and reads only what is cheap there (the engine's
snapshot, the device counters, token counts the loop tallies as outputs pass): neither the
loop nor the engine thread waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.engine.outputs import EngineStats, RequestOutput
from server.hpu.counters import DeviceCounters
from server.hpu.types import Stage
from server.log import FIELDS

logger = logging.getLogger(__name__)

MISSES = "hpu_serve:bucket_misses"


@dataclass(frozen=True, slots=True)
class _Totals:
    """Cumulative figures at one instant."""

    at: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    compilations: int
    bucket_misses: int
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class StatsLog:
    """Tallies tokens as outputs reach the loop (``count``) and writes the line (``run``)."""

    def __init__(self, interval: float, stats: Callable[[], EngineStats],
                 counters: DeviceCounters) -> None:
        self.interval = interval
        self._stats = stats
        self._counters = counters
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def count(self, outputs: list[RequestOutput]) -> None:
        """On the event loop, for each batch of outputs delivered."""
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)
            self.generation_tokens += new
            if new and out.num_generated_tokens == new:  # its first tokens: prefill is done
                self.prompt_tokens += len(out.prompt_token_ids)

    def _misses(self) -> int:
        total = 0.0
        for family in self._counters.registry.collect():
            if family.name == MISSES:
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return int(total)

    def _totals(self, stats: EngineStats) -> _Totals:
        return _Totals(time.monotonic(), self.prompt_tokens, self.generation_tokens,
                       stats.prefix_cache_queries, stats.prefix_cache_hits,
                       stats.num_preemptions, self._counters.compilations(stage=Stage.SERVING),
                       self._misses(), stats.spec_num_draft_tokens,
                       stats.spec_num_accepted_tokens)

    def line(self, last: _Totals | None, last_state: tuple | None
             ) -> tuple[_Totals, tuple, dict[str, object] | None]:
        """(totals now, state now, the line's fields or None when nothing happened)."""
        stats = self._stats()
        now = self._totals(stats)
        state = (stats.num_running, stats.num_waiting, now.compilations, now.bucket_misses,
                 round(stats.kv_cache_usage, 3))
        if last is None:
            return now, state, None  # the baseline: warmup's figures are not this interval's
        flowed = now.prompt_tokens > last.prompt_tokens or \
            now.generation_tokens > last.generation_tokens
        if not flowed and state == last_state:
            return now, state, None
        seconds = max(now.at - last.at, 1e-9)
        queries = now.prefix_queries - last.prefix_queries
        fields: dict[str, object] = {
            "prompt_throughput": round((now.prompt_tokens - last.prompt_tokens) / seconds, 1),
            "generation_throughput": round(
                (now.generation_tokens - last.generation_tokens) / seconds, 1),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_cache_usage": round(stats.kv_cache_usage, 4),
            "prefix_cache_hit_rate": round((now.prefix_hits - last.prefix_hits) / queries, 4)
            if queries else None,
            "preemptions": now.preemptions - last.preemptions,
            "compilations": now.compilations,
            "bucket_misses": now.bucket_misses,
        }
        drafted = now.spec_draft_tokens - last.spec_draft_tokens
        if stats.spec_accepted_per_pos:  # --speculative-config: this interval's acceptance
            fields["spec_acceptance_rate"] = round(
                (now.spec_accepted_tokens - last.spec_accepted_tokens) / drafted, 4
            ) if drafted else None
        return now, state, fields

    async def run(self) -> None:
        """Until cancelled: a line every interval in which something ran or changed."""
        last, last_state = self.line(None, None)[:2]
        while True:
            await asyncio.sleep(self.interval)
            try:
                last, last_state, fields = self.line(last, last_state)
            except Exception:  # a stats bug must not end the server's logs
                logger.exception("the stats line failed")
                continue
            if fields is not None:
                logger.info("Engine stats", extra={FIELDS: fields})
