"""Runtime padding: map each batch to the smallest planned bucket that holds it."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

from server.hpu.counters import DeviceCounters
from server.hpu.types import Bucket, Phase

logger = logging.getLogger(__name__)


class ShapePlanner:
    """Pads batches to warmed-up buckets and counts the batches that fit none.

    Buckets are :class:`Bucket` ``(batch, query, blocks)``: prompt buckets have the
    context blocks (0 without prefix caching and chunked prefill), decode buckets query 1
    and the batch's total blocks. A batch beyond every bucket runs at its exact shape, is
    logged once per shape as not warmed up, and counted as a miss.
    """

    def __init__(self, prompt: Sequence[Bucket], decode: Sequence[Bucket],
                 counters: DeviceCounters) -> None:
        self.buckets: dict[Phase, list[Bucket]] = {
            Phase.PREFILL: sorted(Bucket(*b) for b in prompt),
            Phase.DECODE: sorted(Bucket(*b) for b in decode)}
        self.counters = counters
        self._warned: set[Bucket] = set()

    def find(self, phase: Phase, bs: int, size: int, ctx: int = 0,
             query: int = 1) -> Bucket | None:
        """The lexicographically smallest bucket dominating (bs, size, ctx), as the
        reference implementation picks it (smallest batch first, not least padding). A
        decode's query length is matched exactly: a plain decode and a speculative verify
        step (``query`` tokens per row) lay their inputs out differently."""
        target = exact_bucket(phase, bs, size, ctx, query)
        if phase is Phase.DECODE:
            found = smallest_dominating(self._decode_of(query), target)
            return found if found is not None and found.query == query else None
        return smallest_dominating(self.buckets[phase], target)

    def _decode_of(self, query: int) -> list[Bucket]:
        return [b for b in self.buckets[Phase.DECODE] if b.query == query]

    def prefill_fits(self, num_seqs: int, max_tokens: int,
                     max_num_batched_tokens: int) -> bool:
        """Padding-aware admission: the padded batch must have a bucket, and its padded
        token count (batch * query) must fit the step's token budget."""
        bucket = self.find(Phase.PREFILL, num_seqs, max_tokens)
        return bucket is not None and bucket.batch * bucket.query <= max_num_batched_tokens

    def pad(self, phase: Phase, bs: int, size: int, ctx: int = 0, query: int = 1) -> Bucket:
        """The bucket to run a batch of ``bs`` rows and ``size`` (prompt length or total
        KV blocks) in, after ``ctx`` context blocks (prompts): a planned one, or the exact
        shape when none holds it (a miss)."""
        bucket = self.find(phase, bs, size, ctx, query)
        if bucket is not None:
            return bucket
        self.counters.missed(phase)
        exact = exact_bucket(phase, bs, size, ctx, query)
        if exact not in self._warned:
            self._warned.add(exact)
            logger.warning("Configuration: (%r, %d, %d, %d) was not warmed-up!", str(phase),
                           *exact)
        return exact


def smallest_dominating(buckets: Sequence[Bucket], target: Bucket) -> Bucket | None:
    """The lexicographically smallest of the sorted ``buckets`` that is >= ``target`` in
    every dimension: the runtime's choice, shared with the plan fitter's replay."""
    for bucket in buckets[bisect.bisect_left(buckets, target):]:
        if all(b >= t for b, t in zip(bucket, target)):
            return bucket
    return None


def exact_bucket(phase: Phase, bs: int, size: int, ctx: int = 0, query: int = 1) -> Bucket:
    """The bucket of exactly this shape: ``size`` is the prompt length or total blocks,
    ``ctx`` the prompts' context blocks, ``query`` a decode's tokens per row (more than
    one: a speculative verify step)."""
    return Bucket(bs, size, ctx) if phase is Phase.PREFILL else Bucket(bs, query, size)


def padded_size(phase: Phase, bucket: Bucket) -> tuple[int, int]:
    """(rows, prompt length or total blocks) that a batch in ``bucket`` is padded to."""
    return ((bucket.batch, bucket.query) if phase is Phase.PREFILL
            else (bucket.batch, bucket.blocks))
