"""Shape telemetry stays bounded and, past its cap, rounds shapes up (still covered)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from server.hpu.buckets.observed import ShapeStats, round_up_log
from server.hpu.types import BucketLimits, Phase


def test_round_up_log_never_rounds_down_and_stays_close() -> None:
    for v in range(1, 5000):
        r = round_up_log(v)
        assert v <= r <= max(8, v * 1.2)


def test_counts_are_exact_until_the_cap_then_coarse_and_covering() -> None:
    reg = CollectorRegistry()
    stats = ShapeStats("m", reg, max_shapes=3)
    for q in (16, 32, 16, 48):
        stats.record(Phase.PREFILL, (1, q, 0), q)
    stats.record(Phase.PREFILL, (2, 1000, 5), 1500)  # past the cap: rounded up
    stats.record(Phase.DECODE, (4, 1, 9), 4)
    snap = stats.snapshot()["phases"]
    prompt = snap["prefill"]
    assert prompt["steps"] == 5 and prompt["real_tokens"] == 16 + 32 + 16 + 48 + 1500
    assert prompt["coarsened"] == 1
    shapes = {tuple(s[:3]): s[3] for s in prompt["shapes"]}
    assert shapes[(1, 16, 0)] == 2
    coarse = [s for s in shapes if s[0] == 2]
    assert len(coarse) == 1 and coarse[0][1] >= 1000 and coarse[0][2] == 5
    assert snap["decode"]["shapes"] == [[4, 1, 9, 1]]
    # one series per phase and dimension, not per shape
    series = {s.labels["dim"] + s.labels["phase"] for m in reg.collect() for s in m.samples
              if s.name == "hpu_serve:step_shape_count"}
    assert len(series) == 5


def test_warmup_seconds_add_up_per_bucket() -> None:
    stats = ShapeStats("m", CollectorRegistry())
    stats.warmed(Phase.DECODE, (1, 1, 4), 0.5)
    stats.warmed(Phase.DECODE, (1, 1, 4), 0.25)  # compile, then capture
    assert stats.warmup_seconds(Phase.DECODE) == {(1, 1, 4): 0.75}
    assert stats.snapshot()["warmup_seconds"]["decode"] == [[1, 1, 4, 0.75]]


def test_the_limits_keep_their_json_keys() -> None:
    stats = ShapeStats("m", CollectorRegistry())
    stats.describe(block_size=16, limits=BucketLimits(2048, 32, 4096, 100), plan=None)
    doc = stats.snapshot()
    assert doc["limits"] == {"max_model_len": 2048, "max_num_seqs": 32,
                             "max_num_batched_tokens": 4096, "num_blocks": 100}
    # a document read back gives the same typed limits; unknown ones stay None
    assert BucketLimits.from_json(doc["limits"]) == BucketLimits(2048, 32, 4096, 100)
    assert BucketLimits.from_json({"max_model_len": 64}).max_num_seqs is None
