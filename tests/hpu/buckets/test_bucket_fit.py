"""Fitting a bucket plan to observed shapes: exact 1-D cuts, coverage (replaying every
observed shape with the runtime's own choice gives 0 misses), budgets respected, and the
CLI end to end on a saved JSON dump."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from prometheus_client import CollectorRegistry

from server.cli import main
from server.config import BucketingConfig
from server.hpu.buckets.fit import Observed, WarmupModel, evaluate, optimal_cuts, suggest
from server.hpu.buckets.lookup import ShapePlanner
from server.hpu.buckets.observed import ShapeStats
from server.hpu.buckets.plan import (
    decode_buckets,
    parse_bucket_file,
    prefill_buckets,
    resolve_ranges,
)
from server.hpu.counters import DeviceCounters
from server.hpu.types import BucketLimits, Phase

LIMITS = BucketLimits(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=4096)


def recorded(seed: int = 0, steps: int = 3000) -> ShapeStats:
    """A synthetic trace through the real recorder: log-normal prompts (some after a cached
    prefix), decodes of a fluctuating batch; measured warmup of a few buckets."""
    rng = random.Random(seed)
    stats = ShapeStats("m", CollectorRegistry())
    for _ in range(steps // 10):
        q = min(2000, int(rng.lognormvariate(5.5, 0.9)) + 1)
        bs = rng.choice([1, 1, 1, 2, 3])
        if bs * q > LIMITS.max_num_batched_tokens:
            bs = 1
        ctx = rng.choice([0, 0, 0, rng.randint(1, 8)]) if bs == 1 else 0
        stats.record(Phase.PREFILL, (bs, q, ctx), bs * q)
    for _ in range(steps):
        bs = rng.randint(1, 32)
        stats.record(Phase.DECODE, (bs, 1, bs * rng.randint(1, 10)), bs)
    stats.describe(block_size=16, limits=LIMITS, plan=None)
    stats.warmed(Phase.PREFILL, (1, 128, 0), 2.0)
    stats.warmed(Phase.PREFILL, (1, 1024, 0), 4.0)
    stats.warmed(Phase.DECODE, (8, 1, 64), 1.0)
    return stats


def brute_force(values: list[int], weights: list[float], k: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(values[:-1], k - 1):
        cs = sorted(cuts) + [values[-1]]
        best = min(best, sum(w * (min(c for c in cs if c >= v) - v)
                             for v, w in zip(values, weights)))
    return best


def test_optimal_cuts_match_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(20):
        values = sorted(rng.sample(range(1, 200), 9))
        weights = [rng.random() * 5 for _ in values]
        out = optimal_cuts(values, weights, 9)
        for k in range(1, 10):
            cuts = out[k - 1]
            assert len(cuts) == k and cuts[-1] == values[-1]
            got = sum(w * (min(c for c in cuts if c >= v) - v) for v, w in zip(values, weights))
            assert got == pytest.approx(brute_force(values, weights, k))


@pytest.mark.parametrize("budget", [dict(max_buckets=12), dict(max_buckets=40),
                                    dict(warmup_budget=60.0)])
def test_every_observed_shape_replays_without_a_miss_within_budget(budget) -> None:
    stats = recorded()
    obs = Observed.from_json(json.loads(json.dumps(stats.snapshot())))
    plan = suggest(obs, **budget)
    warmup = WarmupModel(obs.warmup)
    cost = evaluate(obs, plan, warmup)
    if "max_buckets" in budget:
        assert cost.total_buckets <= budget["max_buckets"]
    else:
        assert cost.warmup_seconds <= budget["warmup_budget"] + 1e-6
    # replay with the runtime's planner itself: not one miss
    counters = DeviceCounters("m")
    planner = ShapePlanner(plan[Phase.PREFILL], plan[Phase.DECODE], counters)
    for phase in Phase:
        for (bs, q, ctx), _ in obs.shapes[phase].items():
            size = q if phase is Phase.PREFILL else ctx
            assert planner.find(phase, bs, size, ctx if phase is Phase.PREFILL else 0) is not None
    assert sum(cost.misses.values()) == 0


def test_more_budget_never_pads_more_and_beats_the_default_plan() -> None:
    obs = Observed.from_json(recorded().snapshot())
    warmup = WarmupModel(obs.warmup)
    pads = [evaluate(obs, suggest(obs, max_buckets=k), warmup).total_padded_tokens
            for k in (10, 20, 40, 80)]
    assert pads == sorted(pads, reverse=True)
    ranges = resolve_ranges(BucketingConfig(), block_size=16, max_model_len=2048,
                            max_num_seqs=32, max_num_batched_tokens=4096, with_context=True)
    default = {Phase.PREFILL: prefill_buckets(ranges), Phase.DECODE: decode_buckets(ranges)}
    base = evaluate(obs, default, warmup)
    fitted = evaluate(obs, suggest(obs, max_buckets=base.total_buckets), warmup)
    assert fitted.total_padded_tokens <= 0.7 * base.total_padded_tokens


def test_a_budget_below_the_minimal_covering_plan_is_refused() -> None:
    obs = Observed.from_json(recorded().snapshot())
    with pytest.raises(ValueError, match="budget too small"):
        suggest(obs, max_buckets=2)


def test_cli_suggest_from_a_saved_dump(tmp_path, capsys) -> None:
    dump = tmp_path / "observed.json"
    dump.write_text(json.dumps(recorded().snapshot()))
    out = tmp_path / "buckets.txt"
    assert main(["buckets", "--suggest", "--from", str(dump), "--max-buckets", "30",
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "default exp" in printed and "suggested" in printed
    # the summary line tells the direction right, and says the default plan's misses
    # (steps it cannot pad, so its padding undercounts) are left out of its figure
    found = re.search(r"padded tokens: ([\d,]+) vs ([\d,]+) \([\d.]+% (fewer|more)", printed)
    assert found is not None, printed
    fitted, base = (int(found.group(i).replace(",", "")) for i in (1, 2))
    assert found.group(3) == ("fewer" if fitted <= base else "more")
    assert re.search(r"default exp plan missed \d+ steps", printed)
    buckets = parse_bucket_file(str(out))
    assert 0 < len(buckets) <= 30
    # the server loads every line of it with these limits (nothing filtered away)
    ranges = resolve_ranges(BucketingConfig(file=str(out)), block_size=16, max_model_len=2048,
                            max_num_seqs=32, max_num_batched_tokens=4096, with_context=True)
    assert len(prefill_buckets(ranges)) + len(decode_buckets(ranges)) == len(buckets)
    assert "eager" not in capsys.readouterr().err  # recorded for static shapes: no warning


def test_cli_warns_when_the_shapes_come_from_an_eager_server(tmp_path, capsys) -> None:
    """Eager steps batch prefills (and decodes) that graphs run apart: a fit to them is a
    fit to traffic the plan will never see, so the operator is told where to record."""
    stats = recorded()
    stats.describe(block_size=16, limits=LIMITS, plan=None, static_shapes=False)
    doc = stats.snapshot()
    assert doc["static_shapes"] is False and not Observed.from_json(doc).static_shapes
    dump = tmp_path / "observed.json"
    dump.write_text(json.dumps(doc))
    assert main(["buckets", "--suggest", "--from", str(dump), "--max-buckets", "30",
                 "-o", str(tmp_path / "b.txt")]) == 0
    err = capsys.readouterr().err
    assert "recorded by an eager server" in err and "--execution-mode graphs" in err


def test_largest_buckets_reach_the_engine_limits_unless_told_otherwise() -> None:
    obs = Observed.from_json(recorded().snapshot())
    planner = ShapePlanner(*suggest(obs, max_buckets=40).values(), DeviceCounters("m"))
    # larger than anything observed, within the limits: still a bucket (padding, no compile)
    assert planner.find(Phase.DECODE, 32, 32 * 128) is not None
    assert planner.find(Phase.PREFILL, 1, 2048) is not None
    envelope = suggest(obs, max_buckets=40, cover_limits=False)
    assert max(b[2] for b in envelope[Phase.DECODE]) == max(s[2] for s in obs.shapes[Phase.DECODE])


def test_nothing_observed_yet_is_refused() -> None:
    stats = ShapeStats("m", CollectorRegistry())
    stats.record(Phase.PREFILL, (1, 20, 0), 20)
    stats.describe(block_size=16, limits=LIMITS, plan=None)
    with pytest.raises(ValueError, match="no decode steps observed"):
        suggest(Observed.from_json(stats.snapshot()), max_buckets=10)


def test_query_buckets_step_finer_than_the_block() -> None:
    """Block-aligned query buckets (the reference's step) pad a 145-token prompt to 256
    whatever the plan; the default 32-token step lets the fit follow the prompt lengths."""
    rng = random.Random(4)
    stats = ShapeStats("m", CollectorRegistry())
    for _ in range(300):
        q = rng.randint(140, 300)
        stats.record(Phase.PREFILL, (1, q, 0), q)
    for _ in range(1000):
        bs = rng.randint(1, 16)
        stats.record(Phase.DECODE, (bs, 1, 3 * bs), bs)
    limits = BucketLimits(max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=2048)
    stats.describe(block_size=128, limits=limits, plan=None)
    obs = Observed.from_json(stats.snapshot())
    warmup = WarmupModel({})
    aligned = suggest(obs, max_buckets=30, query_step=128)
    fine = suggest(obs, max_buckets=30)
    assert all(q % 128 == 0 for _, q, _ in aligned[Phase.PREFILL])
    assert all(q % 32 == 0 for _, q, _ in fine[Phase.PREFILL])
    assert any(q % 128 for _, q, _ in fine[Phase.PREFILL])
    cost_aligned, cost_fine = evaluate(obs, aligned, warmup), evaluate(obs, fine, warmup)
    assert sum(cost_fine.misses.values()) == sum(cost_aligned.misses.values()) == 0
    # block-aligned: ~74 padded tokens per prompt; 32-token steps: at most ~31 and a few cuts
    assert cost_fine.padded_tokens[Phase.PREFILL] < 0.5 * cost_aligned.padded_tokens[Phase.PREFILL]
    assert cost_fine.total_buckets <= 30
