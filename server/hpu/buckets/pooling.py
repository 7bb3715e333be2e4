"""Bucket plan of a pooling model (pure functions, no torch): whole inputs of ``batch`` rows
padded to ``query`` tokens, with no context (``blocks`` 0), like fresh prompt buckets.

Batch sizes and lengths double (powers of two, then the limit itself), so padding wastes
under half a batch; a bucket holds at most ``max_num_batched_tokens`` padded tokens.
"""

from __future__ import annotations

from server.hpu.types import Bucket

MIN_POOLING_LEN = 16  # the shortest padded length: short inputs share one bucket


def pooling_buckets(max_model_len: int, max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[Bucket]:
    """Every (batch, length) shape a pooling batch is padded to."""
    lengths = _doubling(min(MIN_POOLING_LEN, max_model_len), max_model_len)
    batches = _doubling(1, max_num_seqs)
    return sorted(Bucket(bs, n, 0) for bs in batches for n in lengths
                  if bs * n <= max(max_num_batched_tokens, n))


def _doubling(lo: int, hi: int) -> list[int]:
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 2
    return [*out, hi]


def fit(buckets: list[Bucket], rows: int, length: int) -> Bucket | None:
    """The smallest planned bucket (fewest padded tokens) holding ``rows`` x ``length``."""
    fitting = [b for b in buckets if b.batch >= rows and b.query >= length]
    return min(fitting, key=lambda b: (b.batch * b.query, b.query)) if fitting else None


def format_pooling_plan(buckets: list[Bucket]) -> str:
    return f"Generated {len(buckets)} pooling buckets [bs, query, num_blocks]: {buckets}"
