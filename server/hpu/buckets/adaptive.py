"""Online re-planning (``--bucketing-strategy adaptive``): buckets added while serving.

Every ``interval`` steps the engine asks :meth:`AdaptiveBuckets.propose` for the one missing
bucket that would have saved the most padding on the traffic observed so far (the same
objective as ``hpu-serve buckets --suggest``). Where the saving exceeds ``min_saving`` of all
tokens computed so far, the engine warms that bucket between two steps (never inside one),
counting its compilation as warmup, and :meth:`added` puts it in the plan. Candidates are
the observed shapes that waste the most where they land today, rounded as a plan's buckets
are (prompt lengths to whole blocks); each is scored by replaying every observed shape with
the runtime's own bucket choice, so a candidate that would capture shapes and pad them more
is never picked.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from server.hpu.buckets.fit import KV_WEIGHT, Observed, WarmupModel, evaluate
from server.hpu.buckets.lookup import ShapePlanner, smallest_dominating
from server.hpu.counters import DeviceCounters
from server.hpu.types import Bucket, BucketLimits, Phase

logger = logging.getLogger(__name__)
CANDIDATES_PER_PHASE = 6


class AdaptiveBuckets:
    """Decides which bucket to add next; the engine warms it (see the module docstring)."""

    def __init__(self, planner: ShapePlanner, counters: DeviceCounters, block_size: int,
                 limits: BucketLimits, interval: int = 256, min_saving: float = 0.01,
                 max_added: int = 32, kv_weight: float = KV_WEIGHT) -> None:
        self.planner = planner
        self.counters = counters
        self.block_size = block_size
        self.limits = limits
        self.interval = interval
        self.min_saving = min_saving
        self.max_added = max_added
        self.kv_weight = kv_weight
        self.added_count = 0
        self._steps = 0
        self._no_warmup = WarmupModel({})  # warmup time is not what is minimised here

    def propose(self) -> tuple[Phase, Bucket] | None:
        """Called between steps: once every ``interval`` calls, the bucket worth adding."""
        self._steps += 1
        if self._steps % self.interval or self.added_count >= self.max_added:
            return None
        obs = Observed.from_json(self.counters.observed.snapshot())
        plan = {p: list(self.planner.buckets[p]) for p in Phase}
        base = self._cost(obs, plan)
        computed = sum(obs.real_tokens.values()) + evaluate(obs, plan, self._no_warmup
                                                            ).total_padded_tokens
        best: tuple[float, Phase, Bucket] | None = None
        for phase, bucket in self._candidates(obs, plan):
            trial = dict(plan)
            trial[phase] = sorted(plan[phase] + [bucket])
            saving = base - self._cost(obs, trial)
            if best is None or saving > best[0]:
                best = (saving, phase, bucket)
        if best is None or best[0] < self.min_saving * max(computed, 1):
            return None
        return best[1], best[2]

    def added(self, phase: Phase, bucket: Bucket) -> None:
        """``bucket`` is warmed: the planner may use it from the next step on."""
        buckets = self.planner.buckets[phase]
        buckets.append(bucket)
        buckets.sort()
        self.added_count += 1
        self.counters.bucket_added(phase, len(buckets))
        logger.info("Adaptive bucketing: added %s bucket %s (%d added so far)", phase,
                    bucket, self.added_count)

    def _cost(self, obs: Observed, plan: Mapping[Phase, list[Bucket]]) -> float:
        c = evaluate(obs, plan, self._no_warmup)
        return (c.total_padded_tokens
                + self.kv_weight * self.block_size * sum(c.padded_kv_blocks.values()))

    def _candidates(self, obs: Observed, plan: Mapping[Phase, list[Bucket]]
                    ) -> list[tuple[Phase, Bucket]]:
        out = []
        for phase in Phase:
            buckets = sorted(plan[phase])
            waste: list[tuple[float, Bucket]] = []
            for shape, n in obs.shapes[phase].items():
                landed = smallest_dominating(buckets, shape)
                if landed is None:
                    continue  # a miss: it runs (and was compiled) at its own shape already
                cand = self._rounded(phase, shape)
                if cand is None or cand in buckets:
                    continue
                rows = (landed.batch * landed.query - cand.batch * cand.query
                        if phase is Phase.PREFILL else landed.batch - cand.batch)
                kv = self.kv_weight * self.block_size * (landed.blocks - cand.blocks)
                waste.append((n * (rows + kv), cand))
            waste.sort(reverse=True)
            out += [(phase, c) for _, c in waste[:CANDIDATES_PER_PHASE]]
        return out

    def _rounded(self, phase: Phase, shape: Bucket) -> Bucket | None:
        if phase is Phase.DECODE:
            return shape
        q = -(-shape.query // self.block_size) * self.block_size
        max_len, max_tokens = self.limits.max_model_len, self.limits.max_num_batched_tokens
        if (max_len is not None and q > max_len) or (
                max_tokens is not None and shape.batch * q > max_tokens):
            return None  # the engine would drop such a bucket
        return shape._replace(query=q)
