"""The vision encoder's phase of a prefill step: the images this step's prompt chunks reach
are encoded (or found in the encoder cache, keyed by image hash) before the language model
runs, and their rows replace the placeholder tokens' embeddings.

Static shapes: the encoder runs on planned buckets (plan.py). LLaVA's processor resizes
every image to one size, so the patches are fixed and the buckets are the image counts 1,
2, 4... up to the most images one step can hold (its token budget over the tokens per
image); fewer images are padded with blank ones. Qwen2.5-VL's images come in any size
within the processor's pixel bounds: they are packed into one sequence whose patch count is
padded to a bucket (batching.py). More than the largest bucket takes several calls. Every
bucket is compiled before the port opens (compile mode), and compilations are counted under
the ``encoder`` label like the steps' own.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter

from server.config import ExecutionMode
from server.engine.core.sequence import Sequence
from server.engine.multimodal.batching import image_batches
from server.engine.multimodal.inputs import ImageSpan
from server.engine.multimodal.plan import EncoderPlan
from server.hpu.counters import DeviceCounters
from server.hpu.types import SyncPoint
from server.models.vision import QwenVision, VisionModel

logger = logging.getLogger(__name__)


class EncoderCache:
    """Encoded images by hash, least recently used dropped past ``capacity`` images; the
    queries and hits are Prometheus counters."""

    def __init__(self, capacity: int, model_name: str, registry: CollectorRegistry) -> None:
        self.capacity = capacity
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        # each count under its own name and vLLM's (its dashboards read vllm:mm_cache_*)
        self._queries = [Counter(name, "Images the vision encoder's cache was asked for.",
                                 ["model_name"], registry=registry).labels(model_name)
                         for name in ("hpu_serve:encoder_cache_queries",
                                      "vllm:mm_cache_queries")]
        self._hits = [Counter(name, "Images found encoded in the vision encoder's cache.",
                              ["model_name"], registry=registry).labels(model_name)
                      for name in ("hpu_serve:encoder_cache_hits", "vllm:mm_cache_hits")]
        self.queries = 0
        self.hits = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        self.queries += 1
        for counter in self._queries:
            counter.inc()
        found = self._items.get(key)
        if found is not None:
            self.hits += 1
            for counter in self._hits:
                counter.inc()
            self._items.move_to_end(key)
        return found

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        self._items[key] = rows
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


class VisionEncoder:
    """Runs the vision tower on bucketed image batches, and builds a prefill's image rows."""

    def __init__(self, vision: VisionModel, plan: EncoderPlan, mode: ExecutionMode,
                 counters: DeviceCounters, device: torch.device, dtype: torch.dtype,
                 cache_images: int) -> None:
        self.vision = vision
        self.plan = plan
        self.counters = counters
        self.device = device
        self.dtype = dtype
        self.hidden = vision.config.text_hidden_size
        self.buckets = list(plan.buckets)
        self.cache = EncoderCache(cache_images, counters.model_name, counters.registry)
        self.compiled = mode is not ExecutionMode.EAGER
        self.batches = image_batches(vision, plan, self.compiled, device, dtype)
        self._run: Any = vision
        if self.compiled and isinstance(vision, QwenVision):
            # Regional compilation: the blocks share one compiled graph per bucket (the
            # window or full mask an input), the rest runs as it is; a whole-tower graph
            # would cost several times the compile time for the same shapes.
            for block in vision.blocks:
                block.compile(backend=self._counting_backend, dynamic=False)
        elif self.compiled:
            self._run = torch.compile(vision, backend=self._counting_backend, dynamic=False)

    def _counting_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.counters.compiled(SyncPoint.ENCODER)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def describe(self) -> str:
        return self.plan.description

    def warmup(self) -> None:
        """Compiles every encoder bucket (before the port opens)."""
        if not self.compiled:
            return
        for n in reversed(self.buckets):
            logger.info("[Warmup][Encoder] %s:%d", "patches" if self.plan.packed else "images",
                        n)
            self._run(*self.batches.dummy(n))

    def encode(self, spans: Seq[ImageSpan]) -> list[torch.Tensor]:
        """Each image's rows ``[tokens, hidden]``, in calls of planned shapes."""
        out: list[torch.Tensor] = []
        for call in self.batches.calls(spans):
            if self.compiled and call.size not in self.buckets:
                self.counters.missed(SyncPoint.ENCODER)
            out += call.split(self._run(*call.inputs))
        return out

    def rows(self, seqs: Seq[Sequence], new_tokens: Seq[int], starts: Seq[int], total: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding rows ``[total, hidden]``, mask ``[total, 1]``) of a prefill whose row
        ``i`` computes ``new_tokens[i]`` tokens from its ``num_computed_tokens``, laid out
        from flat index ``starts[i]``: the image rows where placeholders are, zeros (masked
        off) elsewhere. Images not in the cache are encoded first, each once."""
        embeds = torch.zeros(total, self.hidden, dtype=self.dtype, device=self.device)
        mask = torch.zeros(total, 1, dtype=torch.bool, device=self.device)
        wanted: list[tuple[int, ImageSpan, int, int]] = []  # (flat start, span, lo, hi)
        for seq, n, flat in zip(seqs, new_tokens, starts):
            begin = seq.num_computed_tokens
            for span in seq.images:
                lo, hi = max(begin, span.offset), min(begin + n, span.end)
                if lo < hi:
                    wanted.append((flat + lo - begin, span, lo, hi))
        if not wanted:
            return embeds, mask
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageSpan] = {}
        for _, span, _, _ in wanted:
            if span.hash in found or span.hash in missing:
                continue
            cached = self.cache.get(span.hash)
            if cached is not None:
                found[span.hash] = cached
            else:
                missing[span.hash] = span
        if missing:
            encoded = self.encode(list(missing.values()))
            for key, rows in zip(missing, encoded):
                found[key] = rows
                self.cache.put(key, rows)
        for flat, span, lo, hi in wanted:
            embeds[flat:flat + hi - lo] = found[span.hash][lo - span.offset:hi - span.offset]
            mask[flat:flat + hi - lo] = True
        return embeds, mask

    def image_ends(self, seqs: Seq[Sequence], new_tokens: Seq[int], starts: Seq[int],
                   total: int) -> torch.Tensor | None:
        """``[total]`` the end position (exclusive) of the image each token of a prefill
        belongs to, 0 for text tokens (laid out as :meth:`rows`), for a model whose image
        tokens attend to each other both ways (Gemma 3); None for the others."""
        if not self.vision.config.bidirectional:
            return None
        ends = torch.zeros(total, dtype=torch.long)
        for seq, n, flat in zip(seqs, new_tokens, starts):
            begin = seq.num_computed_tokens
            for span in seq.images:
                lo, hi = max(begin, span.offset), min(begin + n, span.end)
                if lo < hi:
                    ends[flat + lo - begin:flat + hi - begin] = span.end
        return ends.to(self.device)

    def activation_bytes(self) -> int:
        """A bound on the encoder's working memory at its largest bucket, for the start-up
        budget."""
        return self.batches.activation_bytes()
