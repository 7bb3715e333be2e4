"""Device-layer Prometheus series: graph compilations, bucket misses, padding, warmup.

They live in the device layer's own registry; the HTTP layer folds that registry into
``/metrics``, so an operator can prove "zero compilations after warmup".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

from server.hpu.buckets.observed import ShapeStats
from server.hpu.types import CompileLabel, Phase, Stage, SyncPoint

# vLLM exposes no *_created series; neither do we (they double every counter).
disable_created_metrics()

# Step phases plus the sampler's own compilations: the ``phase`` label values.
PHASES: tuple[CompileLabel, ...] = (*Phase, SyncPoint.SAMPLER, SyncPoint.ENCODER)


class DeviceCounters:
    """Counters for one engine; the stage moves from warmup to serving (:meth:`serving`)
    when the port is about to open, and back to warmup only while a bucket is added between
    steps (:meth:`warming`)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._stage = Stage.WARMUP
        r = self.registry
        self._compilations = Counter(
            "hpu_serve:graph_compilations", "Graph compilations (torch.compile / HPU recipes).",
            ["model_name", "phase", "stage"], registry=r)
        self._misses = Counter(
            "hpu_serve:bucket_misses", "Batches that fit no warmed-up bucket.",
            ["model_name", "phase"], registry=r)
        self._padded = Counter("hpu_serve:padded_tokens", "Tokens run, padding included.",
                               ["model_name", "phase"], registry=r)
        self._real = Counter("hpu_serve:real_tokens", "Tokens run that belong to requests.",
                             ["model_name", "phase"], registry=r)
        self._buckets = Gauge("hpu_serve:warmup_buckets", "Buckets planned / warmed / captured.",
                              ["model_name", "phase", "state"], registry=r)
        self._added = Counter("hpu_serve:buckets_added", "Buckets added while serving "
                              "(--bucketing-strategy adaptive), warmed between steps.",
                              ["model_name", "phase"], registry=r)
        self._warmup_seconds = Gauge("hpu_serve:warmup_seconds", "Duration of the warmup.",
                                     ["model_name"], registry=r)
        self._cache_info = Gauge("vllm:cache_config_info", "Information of the KV cache.",
                                 ["model_name", "block_size", "cache_dtype", "num_gpu_blocks"],
                                 registry=r)
        self._kv_bytes = Gauge("hpu_serve:kv_cache_bytes", "Bytes of the allocated KV cache.",
                               ["model_name"], registry=r)
        for phase in PHASES:  # every series exists from the start, at zero
            for stage in Stage:
                self._compilations.labels(model_name, phase, stage)
            self._misses.labels(model_name, phase)
            self._padded.labels(model_name, phase)
            self._real.labels(model_name, phase)
            if isinstance(phase, Phase):
                self._added.labels(model_name, phase)
            for state in ("planned", "warmed", "captured"):
                self._buckets.labels(model_name, phase, state)
        self._warmup_seconds.labels(model_name)
        # unpadded step shapes and per-bucket warmup cost, for fitting the bucket plan
        self.observed = ShapeStats(model_name, r)
        self._totals: dict[tuple[str, str], int] = {}

    def cache_config(self, block_size: int, dtype: object, num_blocks: int,
                     num_bytes: int) -> None:
        name = str(dtype).replace("torch.", "")
        self._cache_info.labels(self.model_name, str(block_size), name, str(num_blocks)).set(1)
        self._kv_bytes.labels(self.model_name).set(num_bytes)

    @property
    def stage(self) -> Stage:
        return self._stage

    def serving(self) -> None:
        """Warmup is over: compilations from now on count as serving."""
        self._stage = Stage.SERVING

    @contextmanager
    def warming(self) -> Iterator[None]:
        """Compilations inside count as warmup (a bucket added between steps), then the
        stage is what it was."""
        stage, self._stage = self._stage, Stage.WARMUP
        try:
            yield
        finally:
            self._stage = stage

    def compiled(self, phase: CompileLabel, count: int = 1) -> None:
        label = str(phase)
        self._compilations.labels(self.model_name, label, str(self._stage)).inc(count)
        key = (label, str(self._stage))
        self._totals[key] = self._totals.get(key, 0) + count

    def compilations(self, phase: CompileLabel | str | None = None,
                     stage: Stage | str | None = None) -> int:
        return sum(v for (p, s), v in self._totals.items()
                   if (phase is None or p == str(phase)) and (stage is None or s == str(stage)))

    def missed(self, phase: CompileLabel) -> None:
        self._misses.labels(self.model_name, phase).inc()

    def tokens(self, phase: Phase, real: int, padded: int) -> None:
        self._real.labels(self.model_name, phase).inc(real)
        self._padded.labels(self.model_name, phase).inc(padded)

    def set_buckets(self, phase: Phase, state: str, count: int) -> None:
        self._buckets.labels(self.model_name, phase, state).set(count)

    def bucket_added(self, phase: Phase, planned: int) -> None:
        """One more bucket warmed while serving; ``planned``: the phase's buckets now."""
        self._added.labels(self.model_name, str(phase)).inc()
        for state in ("planned", "warmed"):
            self.set_buckets(phase, state, planned)

    def set_warmup_seconds(self, seconds: float) -> None:
        self._warmup_seconds.labels(self.model_name).set(seconds)
