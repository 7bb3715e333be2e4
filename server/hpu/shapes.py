"""Runtime padding: map each batch to the smallest planned bucket that holds it."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

from server.hpu.counters import DeviceCounters

logger = logging.getLogger(__name__)

Bucket = tuple[int, int, int]  # (batch size, query length, context blocks)


class ShapePlanner:
    """Pads batches to warmed-up buckets and counts the batches that fit none.

    Prompt buckets are ``(bs, query_len, ctx_blocks)`` (ctx 0 without prefix caching);
    decode buckets ``(bs, 1, total_blocks_of_batch)``. A batch beyond every bucket runs at
    its exact shape, is logged once per shape as not warmed up, and counted as a miss.
    """

    def __init__(self, prompt: Sequence[Bucket], decode: Sequence[Bucket],
                 counters: DeviceCounters) -> None:
        self.buckets: dict[str, list[Bucket]] = {"prompt": sorted(prompt), "decode": sorted(decode)}
        self.counters = counters
        self._warned: set[tuple[str, int, int]] = set()

    def find(self, phase: str, bs: int, size: int) -> Bucket | None:
        """The lexicographically smallest bucket dominating (bs, size), as the reference
        implementation picks it (smallest batch first, not least padding)."""
        target: Bucket = (bs, size, 0) if phase == "prompt" else (bs, 1, size)
        buckets = self.buckets[phase]
        for bucket in buckets[bisect.bisect_left(buckets, target):]:
            if all(b >= t for b, t in zip(bucket, target)):
                return bucket
        return None

    def prefill_fits(self, num_seqs: int, max_tokens: int, token_budget: int) -> bool:
        """Padding-aware admission: the padded batch must have a bucket, and its padded
        token count (bs * query) must fit the step's token budget."""
        bucket = self.find("prompt", num_seqs, max_tokens)
        return bucket is not None and bucket[0] * bucket[1] <= token_budget

    def pad(self, phase: str, exact: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, int]]:
        bs, size = exact
        bucket = self.find(phase, bs, size)
        if bucket is None:
            self.counters.missed(phase)
            if (phase, bs, size) not in self._warned:
                self._warned.add((phase, bs, size))
                logger.warning("Configuration: (%r, %d, %d) was not warmed-up!", phase, bs, size)
            return (bs, size), exact
        padded = (bucket[0], bucket[1]) if phase == "prompt" else (bucket[0], bucket[2])
        return bucket, padded
