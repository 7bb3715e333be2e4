"""Warmup before the port opens: every bucket compiled, graphs captured, sampler exercised.

Log lines keep the reference implementation's shape, so operators' habits (and grep
patterns) carry over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.config import ExecutionMode, WarmupConfig
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import ForwardInputs, ShapeRunner
from server.hpu.types import Bucket, Phase, SyncPoint

logger = logging.getLogger(__name__)

GiB = float(1 << 30)
_LABELS = {Phase.PREFILL: "Prompt", Phase.DECODE: "Decode"}

# (temperature, top_p, top_k): the six sampler configurations of the reference, which runs
# each with batch_changed True and False. They are logged as the reference logs them, but
# only configurations that take different code paths run: our sampler keeps no state
# between batches (batch_changed changes nothing), and its branches depend only on
# greedy / top-p / top-k being in use, not on their values.
SAMPLER_CONFIGS = ((0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 50), (0.3, 0.95, 20),
                   (1.2, 0.8, 100), (0.8, 0.85, 0))


def distinct_sampler_paths(configs: Sequence[tuple[float, float, int]]
                           ) -> list[tuple[float, float, int]]:
    """The first configuration of each (greedy, top-p, top-k) combination."""
    paths: dict[tuple[bool, bool, bool], tuple[float, float, int]] = {}
    for temp, top_p, top_k in configs:
        paths.setdefault((temp == 0.0, top_p < 1.0, top_k > 0), (temp, top_p, top_k))
    return list(paths.values())


@dataclass(slots=True)
class WarmupHooks:
    """What warmup needs from the engine, as plain callables (the device layer does not
    know sequences or samplers)."""

    make_inputs: Callable[[Phase, Bucket], ForwardInputs]
    run_sampler: Callable[[int, tuple[float, float, int]], None]
    free_memory: Callable[[], int]  # bytes free on the device (0 where unknown, e.g. CPU)


def run_warmup(buckets: dict[Phase, Sequence[Bucket]], runner: ShapeRunner, hooks: WarmupHooks,
               counters: DeviceCounters, cfg: WarmupConfig) -> float:
    """Runs every bucket once (compiling it), captures graphs within the memory budget and
    warms the sampler; returns the seconds it took. Counters move to "serving" after."""
    start = time.monotonic()
    for phase in Phase:
        counters.set_buckets(phase, "planned", len(buckets[phase]))
    if cfg.skip:
        logger.info("Skipping warmup (VLLM_SKIP_WARMUP=true): shapes compile on first use")
        counters.serving()
        return 0.0
    if not runner.needs_warmup:
        # Nothing to compile or capture: running every bucket would only burn time.
        logger.info("Eager execution: no graphs to compile or capture, warmup skipped")
        counters.serving()
        return 0.0
    for phase in Phase:
        # Largest first, like the reference: the peak memory shows up at once.
        ordered = sorted(buckets[phase], key=lambda b: (b.batch * max(b.query, b.blocks), b),
                         reverse=True)
        for i, bucket in enumerate(ordered, 1):
            _log_step(_LABELS[phase], i, len(ordered), bucket, hooks)
            began = time.monotonic()
            runner.warm(phase, bucket, hooks.make_inputs(phase, bucket))
            # per-bucket cost: what a bucket plan's warmup-time budget is made of
            counters.observed.warmed(phase, bucket, time.monotonic() - began)
        counters.set_buckets(phase, "warmed", len(ordered))
        if not runner.captures_graphs:  # compiled graphs (or recorded ones) replay as they are
            counters.set_buckets(phase, "captured", len(ordered) if runner.mode is not ExecutionMode.EAGER else 0)
    if runner.captures_graphs:
        _capture_graphs(buckets, runner, hooks, counters, cfg)
    _warm_sampler(buckets, runner, hooks)
    seconds = time.monotonic() - start
    counters.set_warmup_seconds(seconds)
    counters.serving()
    logger.info("Warmup finished in %.0f secs, %d graph compilations", seconds,
                counters.compilations(stage="warmup"))
    return seconds


def _log_step(label: str, i: int, total: int, bucket: Bucket, hooks: WarmupHooks) -> None:
    seq_len = bucket.query if label.endswith("Prompt") else bucket.blocks
    logger.info("[Warmup][%s][%d/%d] batch_size:%d seq_len:%d free_mem:%.2f GiB", label, i,
                total, bucket.batch, seq_len, hooks.free_memory() / GiB)


def capture_order(buckets: Sequence[Bucket], strategy: str) -> list[Bucket]:
    """``min_tokens``: cheapest graphs first; ``max_bs``: largest batches first (decode
    under load runs at the maximum batch size)."""
    if strategy == "max_bs":
        return sorted(buckets, key=lambda b: (-b.batch, b.query * b.blocks or b.query))
    return sorted(buckets, key=lambda b: (b.batch * max(b.query, b.blocks), b))


def _capture_graphs(buckets: dict[Phase, Sequence[Bucket]], runner: ShapeRunner,
                    hooks: WarmupHooks, counters: DeviceCounters, cfg: WarmupConfig) -> None:
    free = hooks.free_memory()
    budget = free * cfg.graph_reserved_mem
    budgets = {Phase.PREFILL: budget * cfg.graph_prompt_ratio,
               Phase.DECODE: budget * (1 - cfg.graph_prompt_ratio)}
    logger.info("Using %.2f GiB/%.2f GiB of free device memory for graphs, %.3f GiB for prompt "
                "and %.3f GiB for decode (VLLM_GRAPH_PROMPT_RATIO=%s)", budget / GiB, free / GiB,
                budgets[Phase.PREFILL] / GiB, budgets[Phase.DECODE] / GiB, cfg.graph_prompt_ratio)
    strategies = {Phase.PREFILL: cfg.prompt_strategy, Phase.DECODE: cfg.decode_strategy}
    for phase in Phase:
        label = _LABELS[phase]
        ordered = capture_order(buckets[phase], strategies[phase])
        captured: list[Bucket] = []
        used = 0.0
        for i, bucket in enumerate(ordered, 1):
            before = hooks.free_memory()
            if used >= budgets[phase]:
                break  # budget spent: the remaining buckets run compiled but uncaptured
            _log_step(f"Graph/{label}", i, len(ordered), bucket, hooks)
            began = time.monotonic()
            runner.capture(phase, bucket, hooks.make_inputs(phase, bucket))
            counters.observed.warmed(phase, bucket, time.monotonic() - began)
            used += max(0, before - hooks.free_memory())
            captured.append(bucket)
        counters.set_buckets(phase, "captured", len(captured))
        share = 100.0 * len(captured) / max(1, len(ordered))
        logger.info("Graph/%s captured:%d (%.1f%%) used_mem:%.2f GiB buckets:%s", label,
                    len(captured), share, used / GiB, sorted(captured))


def _warm_sampler(buckets: dict[Phase, Sequence[Bucket]], runner: ShapeRunner,
                  hooks: WarmupHooks) -> None:
    sizes = [1] + sorted({b.batch for b in buckets[Phase.DECODE]} - {1})
    logger.info("Warming up sampler with batch sizes: %s and following configs:", sizes)
    for changed in (True, False):
        for temp, top_p, top_k in SAMPLER_CONFIGS:
            logger.info("temp=%s, top_p=%s, top_k=%d, batch_changed=%s", temp, top_p, top_k,
                        changed)
    logger.info("Starting sampler warmup...")
    for bs in sizes:
        for config in distinct_sampler_paths(SAMPLER_CONFIGS):
            hooks.run_sampler(bs, config)
            runner.sync(SyncPoint.SAMPLER)
    logger.info("Sampler warmup completed successfully")
