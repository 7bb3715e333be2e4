"""The vision encoder's phase of a prefill step: the images this step's prompt chunks reach
are encoded (or found in the encoder cache, keyed by image hash) before the language model
runs, and their rows replace the placeholder tokens' embeddings.

Static shapes: the encoder runs on planned buckets of (images per call, patches per image);
LLaVA's processor resizes every image to one size, so the patches are fixed and the buckets
are the image counts 1, 2, 4... up to the most images one step can hold (its token budget
over the tokens per image). More images than the largest bucket take several calls; fewer
are padded with blank images. Every bucket is compiled before the port opens (compile
mode), and compilations are counted under the ``encoder`` label like the steps' own.
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
from server.engine.multimodal.inputs import ImageSpan
from server.hpu.buckets.encoder import encoder_buckets, format_encoder_plan
from server.hpu.counters import DeviceCounters
from server.hpu.types import SyncPoint
from server.models.vision import LlavaVision

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

    def __init__(self, vision: LlavaVision, mode: ExecutionMode, counters: DeviceCounters,
                 device: torch.device, dtype: torch.dtype, max_images: int,
                 cache_images: int) -> None:
        self.vision = vision
        self.counters = counters
        self.device = device
        self.dtype = dtype
        self.hidden = vision.config.text_hidden_size
        self.pixel_shape = vision.pixel_shape()
        self.buckets = encoder_buckets(max(1, max_images))
        self.cache = EncoderCache(cache_images, counters.model_name, counters.registry)
        self.compiled = mode is not ExecutionMode.EAGER
        self._run = (torch.compile(vision, backend=self._counting_backend, dynamic=False)
                     if self.compiled else vision)

    def _counting_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.counters.compiled(SyncPoint.ENCODER)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    def describe(self) -> str:
        c, h, w = self.pixel_shape
        return format_encoder_plan(self.buckets, self.vision.config.num_patches,
                                   f"{c}x{h}x{w}")

    def warmup(self) -> None:
        """Compiles every encoder bucket (before the port opens)."""
        if not self.compiled:
            return
        for n in reversed(self.buckets):
            logger.info("[Warmup][Encoder] images:%d patches:%d", n,
                        self.vision.config.num_patches)
            self._call(torch.zeros(n, *self.pixel_shape, dtype=self.dtype, device=self.device))

    def _call(self, pixels: torch.Tensor) -> torch.Tensor:
        n = pixels.shape[0]
        if self.compiled and n not in self.buckets:
            self.counters.missed(SyncPoint.ENCODER)
        return self._run(pixels)

    def encode(self, pixels: Seq[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows ``[tokens, hidden]``: in calls of the largest bucket, the last
        call padded up to the smallest bucket that holds the rest."""
        out: list[torch.Tensor] = []
        largest = self.buckets[-1]
        for at in range(0, len(pixels), largest):
            group = list(pixels[at:at + largest])
            size = next(b for b in self.buckets if b >= len(group)) if self.compiled \
                else len(group)
            batch = torch.zeros(size, *self.pixel_shape, dtype=self.dtype, device=self.device)
            batch[:len(group)] = torch.stack(group).to(self.device, self.dtype)
            rows = self._call(batch)
            # copies: a view would keep the whole padded batch alive in the cache
            out += [r.clone() for r in rows[:len(group)]]
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
            encoded = self.encode([s.pixels for s in missing.values()])
            for key, rows in zip(missing, encoded):
                found[key] = rows
                self.cache.put(key, rows)
        for flat, span, lo, hi in wanted:
            embeds[flat:flat + hi - lo] = found[span.hash][lo - span.offset:hi - span.offset]
            mask[flat:flat + hi - lo] = True
        return embeds, mask

    def activation_bytes(self) -> int:
        """A bound on the encoder's working memory at its largest bucket: a few layer-wide
        tensors per token (attention scores included), for the start-up budget."""
        c = self.vision.config
        tokens = (c.num_patches + 1) * self.buckets[-1]
        per_token = 6 * c.hidden_size + 2 * c.intermediate_size + c.num_heads * (c.num_patches + 1)
        return tokens * per_token * torch.finfo(self.dtype).bits // 8
