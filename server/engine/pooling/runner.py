"""Runs pooling batches on planned shapes: the whole input padded to a (batch, length)
bucket, token states pooled inside the same graph; every bucket warmed before serving and
counted by the device counters (compilations, misses, padding) under the prefill phase."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from server.config import ExecutionMode
from server.engine.pooling.pooler import pool
from server.hpu.buckets.pooling import fit
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import CompiledRunner, EagerRunner, GraphRunner
from server.hpu.types import Bucket, Phase
from server.models.encoders.load import LoadedPoolingModel

logger = logging.getLogger(__name__)

# pooling batches are prompts with no cache: counted as prefill steps
PHASE = Phase.PREFILL


@dataclass(slots=True)
class EncoderInputs:
    """Device tensors of one padded batch; every shape fixed by its bucket."""

    input_ids: torch.Tensor  # [bs, n]
    token_types: torch.Tensor  # [bs, n]
    lengths: torch.Tensor  # [bs] (padding rows: 0)


@dataclass(frozen=True, slots=True)
class EncoderRow:
    """One input of a batch: its tokens and, for a pair, their segment ids."""

    token_ids: list[int]
    token_types: tuple[int, ...] | None


class PoolingRunner:
    """The pooled vectors (or class logits) of a batch of inputs, in planned shapes."""

    def __init__(self, loaded: LoadedPoolingModel, device: torch.device, mode: ExecutionMode,
                 counters: DeviceCounters, buckets: list[Bucket]) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        self.counters = counters
        self.buckets = buckets
        # class logits come from the states the head reads (the first token for BERT, the
        # last for causal LMs, CLS or the mean for ModernBERT): pooled the same way
        self.pooling = loaded.head_pooling if loaded.classify else loaded.pooling
        self.graphs: GraphRunner
        if mode is ExecutionMode.EAGER:
            self.graphs = EagerRunner(self._forward, counters)  # type: ignore[arg-type]
        else:  # graphs: no capture for pooling yet, compiled shapes instead
            self.graphs = CompiledRunner(self._forward, counters)  # type: ignore[arg-type]
        self.mode = mode
        counters.set_buckets(PHASE, "planned", len(buckets))

    def _forward(self, inputs: EncoderInputs) -> torch.Tensor:
        hidden = self.model(inputs.input_ids, inputs.token_types, inputs.lengths)
        pooled = pool(hidden, inputs.lengths, self.pooling)
        if self.loaded.classify:
            return self.model.head(pooled.to(hidden.dtype)).float()
        return pooled.float()

    def _inputs(self, rows: list[EncoderRow], bucket: Bucket) -> EncoderInputs:
        ids = torch.zeros(bucket.batch, bucket.query, dtype=torch.long)
        types = torch.zeros(bucket.batch, bucket.query, dtype=torch.long)
        lengths = torch.zeros(bucket.batch, dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            ids[i, :n] = torch.tensor(row.token_ids)
            if row.token_types is not None:
                types[i, :n] = torch.tensor(row.token_types)
            lengths[i] = n
        return EncoderInputs(ids.to(self.device), types.to(self.device),
                             lengths.to(self.device))

    def bucket_for(self, rows: int, length: int) -> Bucket | None:
        return fit(self.buckets, rows, length)

    @torch.inference_mode()
    def execute(self, rows: list[EncoderRow]) -> torch.Tensor:
        """``[len(rows), dim]`` float32 on the host."""
        length = max(len(r.token_ids) for r in rows)
        bucket = self.bucket_for(len(rows), length)
        if bucket is None:  # the scheduler never forms such a batch; run it exactly
            self.counters.missed(PHASE)
            bucket = Bucket(len(rows), length, 0)
        self.counters.tokens(PHASE, sum(len(r.token_ids) for r in rows),
                             bucket.batch * bucket.query)
        out = self.graphs.run(PHASE, bucket, self._inputs(rows, bucket))
        return out[:len(rows)].cpu()

    @torch.inference_mode()
    def warmup(self) -> float:
        """Runs every planned bucket once (compiling it in compile mode); seconds spent."""
        start = time.monotonic()
        if self.graphs.needs_warmup:
            for bucket in self.buckets:
                rows = [EncoderRow([0] * bucket.query, None)] * bucket.batch
                self.graphs.warm(PHASE, bucket, self._inputs(rows, bucket))
        seconds = time.monotonic() - start
        self.counters.set_buckets(PHASE, "warmed", len(self.buckets))
        self.counters.set_warmup_seconds(seconds)
        self.counters.serving()
        logger.info("Warmed %d pooling buckets (%s) in %.1f s, %d compilations",
                    len(self.buckets), self.graphs.description, seconds,
                    self.counters.compilations(PHASE))
        return seconds
