"""Shape telemetry: the unpadded shape of every step, and what each bucket cost to warm up.

The bucket plan should fit the traffic the server actually sees, so the engine records each
step's shape *before* padding (``hpu-serve buckets --suggest`` fits a plan to it). Two views,
both of bounded size whatever the traffic:

* exact counts per shape in a dict capped at ``max_shapes`` keys; past the cap a new shape is
  rounded *up* onto a log-spaced grid (quarter octaves) before counting, so the dict stays
  bounded and a plan covering the recorded shapes still covers the real ones;
* log-spaced Prometheus histograms per phase and dimension (a handful of series, never one
  per shape), for dashboards.

Per-bucket warmup seconds are measured by the warmup and kept here too (JSON + a histogram).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from server.hpu.types import Bucket, BucketLimits, Phase

FORMAT = "hpu-serve/observed-shapes/v1"
# powers of two up to 128k: batch sizes, query tokens and KV blocks all fit
SIZE_BUCKETS = tuple(float(2 ** i) for i in range(18))
WARMUP_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)
# (dimension label, index into the shape tuple) exported per phase
DIMS = {Phase.PREFILL: (("bs", 0), ("query_tokens", 1), ("ctx_blocks", 2)),
        Phase.DECODE: (("bs", 0), ("ctx_blocks", 2))}


def round_up_log(value: int, steps_per_octave: int = 4) -> int:
    """The smallest grid value >= ``value`` (values up to 8 are kept exactly): the grid is
    ``ceil(2 ** (k / steps_per_octave))``, so rounding up costs at most ~19% per dimension."""
    if value <= 8:
        return value
    k = math.ceil(math.log2(value) * steps_per_octave - 1e-9)
    while math.ceil(2 ** (k / steps_per_octave)) < value:  # float edge cases
        k += 1
    return math.ceil(2 ** (k / steps_per_octave))


class ShapeStats:
    """Histogram of unpadded step shapes (phase -> shape -> steps) plus per-bucket warmup
    cost. Written by the engine thread, read by the API's thread: a lock guards the dicts."""

    def __init__(self, model_name: str, registry: CollectorRegistry,
                 max_shapes: int = 4096) -> None:
        self.model_name = model_name
        self.max_shapes = max_shapes
        self._lock = threading.Lock()
        self._counts: dict[Phase, dict[Bucket, int]] = {p: {} for p in Phase}
        self._real: dict[Phase, int] = {p: 0 for p in Phase}
        self._coarsened: dict[Phase, int] = {p: 0 for p in Phase}
        self._warmup: dict[Phase, dict[Bucket, float]] = {p: {} for p in Phase}
        self._context: dict[str, Any] = {}
        self._plan: Mapping[Phase, Sequence[Bucket]] | None = None
        self._sizes = Histogram(
            "hpu_serve:step_shape", "Unpadded step shapes by phase and dimension (rows, "
            "query tokens, context blocks) before bucket padding.",
            ["model_name", "phase", "dim"], buckets=SIZE_BUCKETS, registry=registry)
        self._warm_seconds = Histogram(
            "hpu_serve:bucket_warmup_seconds", "Warmup (compile + capture) seconds per bucket.",
            ["model_name", "phase"], buckets=WARMUP_BUCKETS, registry=registry)
        for phase, dims in DIMS.items():  # every series exists from the start
            for dim, _ in dims:
                self._sizes.labels(model_name, str(phase), dim)
            self._warm_seconds.labels(model_name, str(phase))

    def describe(self, *, block_size: int, limits: BucketLimits,
                 plan: Mapping[Phase, Sequence[Bucket]] | None,
                 static_shapes: bool = True) -> None:
        """What the JSON dump carries besides counts: the block size, the engine limits,
        the plan in use (``None`` when bucketing is off), so a suggestion can compare, and
        whether the engine schedules for static shapes (graphs, compile) or eagerly: an
        eager engine batches prefills that graphs would run apart, so its shapes are not
        the ones a plan will meet."""
        self._context = {"block_size": block_size, "limits": limits.to_json(),
                         "static_shapes": static_shapes}
        self._plan = plan  # kept by reference: buckets added while serving show up too

    def record(self, phase: Phase, shape: Bucket, real_tokens: int) -> None:
        """One step of unpadded ``shape`` (``exact_bucket`` form) carrying ``real_tokens``."""
        for dim, i in DIMS[phase]:
            self._sizes.labels(self.model_name, str(phase), dim).observe(shape[i])
        with self._lock:
            counts = self._counts[phase]
            if shape not in counts and len(counts) >= self.max_shapes:
                # full: count it on the coarse grid (rounded up, so still covered)
                self._coarsened[phase] += 1
                shape = Bucket(*map(round_up_log, shape))
            counts[shape] = counts.get(shape, 0) + 1
            self._real[phase] += real_tokens

    def warmed(self, phase: Phase, bucket: Bucket, seconds: float) -> None:
        """Warmup spent ``seconds`` on ``bucket`` (called per compile and per capture)."""
        self._warm_seconds.labels(self.model_name, str(phase)).observe(seconds)
        with self._lock:
            self._warmup[phase][bucket] = self._warmup[phase].get(bucket, 0.0) + seconds

    def warmup_seconds(self, phase: Phase) -> dict[Bucket, float]:
        with self._lock:
            return dict(self._warmup[phase])

    def snapshot(self) -> dict[str, Any]:
        """The JSON document of ``GET /buckets/observed`` (read by ``buckets --suggest``)."""
        with self._lock:
            phases = {str(p): {"steps": sum(self._counts[p].values()),
                               "real_tokens": self._real[p],
                               "coarsened": self._coarsened[p],
                               "shapes": [[*s, n] for s, n in sorted(self._counts[p].items())]}
                      for p in Phase}
            warmup = {str(p): [[*b, round(s, 6)] for b, s in sorted(self._warmup[p].items())]
                      for p in Phase}
        plan = None if self._plan is None else {
            str(p): [list(b) for b in list(self._plan[p])] for p in Phase}
        return {"format": FORMAT, "model_name": self.model_name, **self._context,
                "plan": plan, "phases": phases, "warmup_seconds": warmup}
