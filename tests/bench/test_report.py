"""Benchmark arithmetic: percentiles, TPOT, throughputs, failures."""

from __future__ import annotations

import numpy as np
import pytest

from server.bench.client import RequestResult
from server.bench.report import format_summary, percentile, summarize


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    values = list(rng.exponential(size=97))
    for p in (0, 50, 95, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))
    assert percentile([], 50) == 0.0


def test_summary_figures() -> None:
    results = [
        RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1]),
        RequestResult(ok=True, prompt_len=20, output_tokens=3, ttft=0.3, latency=0.7,
                      itl=[0.2, 0.2]),
        RequestResult(ok=False, prompt_len=30, error="HTTP 401: no"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert (s.input_tokens, s.output_tokens) == (30, 8)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.total_token_throughput == pytest.approx(19.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    # TPOT = (latency - ttft) / (tokens - 1): 0.4/4 = 100 ms and 0.4/2 = 200 ms
    assert s.tpot_ms.mean == pytest.approx(150.0)
    assert s.itl_ms.p50 == pytest.approx(100.0)
    assert s.e2e_ms.p99 == pytest.approx(698.0)
    assert s.errors == ["HTTP 401: no"]
    text = format_summary(s)
    assert "Output token throughput (tok/s):" in text
    assert "4.00" in text
