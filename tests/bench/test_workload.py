"""Synthetic workloads are reproducible and have the token lengths asked for."""

from __future__ import annotations

import os
import statistics

import pytest

from server.bench.workload import WorkloadSpec, arrival_gaps, synthetic_requests
from server.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_model_path(*smollm2_gguf)


@pytest.mark.slow
def test_prompts_have_the_requested_token_count(smollm2_tokenizer) -> None:
    spec = WorkloadSpec(num_prompts=12, input_len=200, output_len=128, seed=3)
    special = set(smollm2_tokenizer.hf.all_special_ids)
    requests = synthetic_requests(spec, smollm2_tokenizer, special)
    for req in requests:
        n = len(smollm2_tokenizer.encode(req.prompt, add_special_tokens=False))
        assert n == req.prompt_len  # the recorded length is the real one
        assert abs(n - 200) <= 2, n
        assert req.output_len == 128
        assert not any(tok in req.prompt for tok in smollm2_tokenizer.hf.all_special_tokens)
    assert len({r.prompt for r in requests}) == len(requests)


def test_same_seed_same_workload_other_seed_differs(tiny_model) -> None:
    tok = Tokenizer.from_model_path(tiny_model[0])
    spec = WorkloadSpec(num_prompts=6, input_len=20, output_len=16, range_ratio=0.5, seed=1)
    first = synthetic_requests(spec, tok)
    assert first == synthetic_requests(spec, tok)
    other = synthetic_requests(WorkloadSpec(6, 20, 16, 0.5, seed=2), tok)
    assert [r.prompt for r in other] != [r.prompt for r in first]
    for req in first:
        assert 8 <= req.output_len <= 24
        assert 8 <= req.prompt_len <= 32


def test_arrivals_infinite_rate_and_poisson_mean() -> None:
    assert list(arrival_gaps(float("inf"), 5, seed=0)) == [0.0] * 5
    gaps = list(arrival_gaps(4.0, 4000, seed=0))
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # Poisson arrivals: exponential gaps have a coefficient of variation of 1.
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = list(arrival_gaps(4.0, 4000, seed=0, burstiness=0.25))
    assert statistics.stdev(bursty) / statistics.fmean(bursty) > 1.5


def test_shared_prefix_and_long_prompt_mix(tiny_model) -> None:
    tok = Tokenizer.from_model_path(tiny_model[0])
    spec = WorkloadSpec(num_prompts=10, input_len=12, output_len=4, seed=5,
                        shared_prefix_len=40, long_fraction=0.3, long_input_len=100)
    requests = synthetic_requests(spec, tok)
    common = os.path.commonprefix([r.prompt for r in requests])
    prefix = common[:common.rindex("\n") + 1]
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    assert len(prefix_ids) >= 40  # the tiny tokenizer re-encodes random bytes longer
    for r in requests:
        ids = tok.encode(r.prompt, add_special_tokens=False)
        assert len(ids) == r.prompt_len
        assert ids[:len(prefix_ids)] == prefix_ids  # a cache can reuse the prefix's blocks
    own = sorted(r.prompt_len - len(prefix_ids) for r in requests)
    assert min(own[-3:]) > 3 * max(own[:-3])  # exactly 3 of 10 are the long ones
    assert synthetic_requests(spec, tok) == requests
