"""Turns per-request measurements into the numbers a serving benchmark reports."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from server.bench.client import RequestResult

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no data."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class Distribution:
    """Milliseconds: mean, median and tail percentiles of one latency."""

    mean: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        ms = [v * 1000 for v in values]
        return cls(statistics.fmean(ms), *(percentile(ms, p) for p in PERCENTILES))


@dataclass(slots=True)
class BenchSummary:
    """The headline figures of one run."""

    duration_s: float
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution = field(default_factory=Distribution)
    tpot_ms: Distribution = field(default_factory=Distribution)
    itl_ms: Distribution = field(default_factory=Distribution)
    e2e_ms: Distribution = field(default_factory=Distribution)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: Sequence[RequestResult], duration_s: float) -> BenchSummary:
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    # TPOT excludes the first token (that is TTFT) and requests of one token.
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    duration = max(duration_s, 1e-9)
    return BenchSummary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(results) - len(ok),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
        ttft_ms=Distribution.of_seconds([r.ttft for r in ok]),
        tpot_ms=Distribution.of_seconds(tpots),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itl]),
        e2e_ms=Distribution.of_seconds([r.latency for r in ok]),
        errors=sorted({r.error for r in results if not r.ok})[:10],
    )


def format_summary(s: BenchSummary, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(name: str, value: float, fmt: str = ".2f") -> None:
        lines.append(f"{name:<44}{value:>16{fmt}}")

    row("Successful requests:", s.completed, "d")
    row("Failed requests:", s.failed, "d")
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.input_tokens, "d")
    row("Total generated tokens:", s.output_tokens, "d")
    row("Request throughput (req/s):", s.request_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total token throughput (tok/s):", s.total_token_throughput)
    sections = (
        ("Time to First Token", "TTFT", s.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", s.tpot_ms),
        ("Inter-token Latency", "ITL", s.itl_ms),
        ("End-to-end Latency", "E2EL", s.e2e_ms),
    )
    for label, short, dist in sections:
        lines.append(f"{' ' + label + ' ':-^60}")
        row(f"Mean {short} (ms):", dist.mean)
        row(f"Median {short} (ms):", dist.p50)
        row(f"P95 {short} (ms):", dist.p95)
        row(f"P99 {short} (ms):", dist.p99)
    for err in s.errors:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)
