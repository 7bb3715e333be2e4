"""Executing the model on pre-planned shapes: one small interface, one backend per mode.

:class:`ShapeRunner` is what the model runner and warmup call: ``run(phase, bucket,
inputs)`` executes a padded batch; ``warm`` compiles that shape ahead of serving and
``capture`` records a replayable device graph of it (runners that capture); its nature
(mode, description, whether it needs warmup or captures) says how shapes become device work.
:class:`GraphRunner` implements it for a forward given as a plain callable of
:class:`ForwardInputs`: it knows nothing of models or requests. Platforms bring their own
runners (``cuda.py``, ``gaudi.py``); eager and ``torch.compile`` live here. A runner may
also wrap another (tensor parallelism's rank 0 has every rank run what it runs).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from server.config import ExecutionMode
from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters
from server.hpu.state_cache import StateInputs
from server.hpu.types import Bucket, Phase, SyncPoint

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardInputs:
    """Device tensors of one padded batch; every shape is fixed by its bucket."""

    input_ids: torch.Tensor  # [bs, q]
    positions: torch.Tensor  # [bs, q]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [bs] flat index of each row's last token (pads: 0)
    num_seqs: int  # real rows; the rest is padding
    # --enable-lora: each token's adapter slot ([bs * q], 0: none); None without LoRA
    lora_slots: torch.Tensor | None = None
    # hybrid models (Qwen3-Next): each row's state slot; None for the others
    state: StateInputs | None = None
    # vision-language prefills: image rows ([bs * q, hidden]) where mm_mask ([bs * q, 1])
    # is set, replacing those tokens' embeddings; None in decodes and text-only models
    mm_embeds: torch.Tensor | None = None
    mm_mask: torch.Tensor | None = None
    # an EAGLE / MTP head's steps: [2, bs * q] feature-store rows, where each token's hidden
    # input is read (its previous position's) and where its own output is written
    spec_slots: torch.Tensor | None = None


ForwardFn = Callable[[ForwardInputs], torch.Tensor]


class ShapeRunner(ABC):
    """Runs padded batches on planned shapes: what the model runner and warmup call."""

    @property
    @abstractmethod
    def mode(self) -> ExecutionMode:
        """The execution mode it implements."""

    @property
    @abstractmethod
    def description(self) -> str:
        """What the warmup log calls it ("CUDA graphs", "torch.compile (inductor)"...)."""

    @property
    @abstractmethod
    def needs_warmup(self) -> bool:
        """Whether running a shape the first time compiles something, so warmup must run
        every bucket before serving (false only for plain eager PyTorch)."""

    @property
    @abstractmethod
    def captures_graphs(self) -> bool:
        """Whether warmup should capture graphs (within VLLM_GRAPH_RESERVED_MEM) after
        warming."""

    @property
    @abstractmethod
    def warmed(self) -> dict[Phase, set[Bucket]]:
        """The buckets warmed so far, per phase."""

    @abstractmethod
    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        """Logits of a batch padded to ``bucket``."""

    @abstractmethod
    def warm(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        """Compile one bucket before serving."""

    @abstractmethod
    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        """Record a replayable graph of one bucket (only where ``captures_graphs``)."""

    @abstractmethod
    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        """Whether ``run`` replays a captured graph for this bucket."""

    @abstractmethod
    def sync(self, point: SyncPoint) -> None:
        """Ends the device work issued since the last step (sampling, on a device that
        queues ops lazily) and counts what that compiled under ``point``."""


class GraphRunner(ShapeRunner):
    """Runs ``forward`` for padded batches; subclasses decide how shapes become graphs,
    and say so with class attributes ``mode`` and ``description`` (and ``needs_warmup``,
    ``captures_graphs`` where they differ from these defaults)."""

    needs_warmup = True
    captures_graphs = False

    def __init__(self, forward: ForwardFn, counters: DeviceCounters) -> None:
        self.forward = forward
        self.counters = counters
        self._warmed: dict[Phase, set[Bucket]] = {Phase.PREFILL: set(), Phase.DECODE: set()}

    @property
    def warmed(self) -> dict[Phase, set[Bucket]]:
        return self._warmed

    def warm(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        """Compile one bucket before serving (running it once does that)."""
        self.run(phase, bucket, inputs)
        self.warmed[phase].add(bucket)

    @abstractmethod
    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        """Logits of a batch padded to ``bucket``."""

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        """Record a replayable graph of one bucket (only where ``captures_graphs``)."""
        raise NotImplementedError(f"{self.description} does not capture graphs")

    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        """Whether ``run`` replays a captured graph for this bucket."""
        del phase, bucket
        return False

    def sync(self, point: SyncPoint) -> None:
        """Ends the device work issued since the last step (sampling, on a device that
        queues ops lazily) and counts what that compiled under ``point``."""
        del point


class EagerRunner(GraphRunner):
    """``--enforce-eager``: plain PyTorch, no graphs."""

    mode = ExecutionMode.EAGER
    description = "eager"
    needs_warmup = False

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        return self.forward(inputs)


class CompiledRunner(GraphRunner):
    """``torch.compile`` with static shapes: each new bucket shape is one real compilation,
    counted when dynamo hands a graph to the backend (torch's own compile event)."""

    mode = ExecutionMode.COMPILE
    description = "torch.compile (inductor)"

    def __init__(self, forward: ForwardFn, counters: DeviceCounters, backend: str = "inductor",
                 max_shapes: int = 512, regions: list[torch.nn.Module] | None = None) -> None:
        super().__init__(forward, counters)
        import torch._dynamo

        # One cache entry per bucket shape: the default limit (8) would silently fall back
        # to eager after a handful of buckets.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    max_shapes)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, max_shapes)
        self._backend = backend
        self.description = f"torch.compile ({backend})"
        self._phase = Phase.PREFILL
        if regions:
            # Regional compilation: identical layers share one compiled graph per shape, so
            # warmup compiles a layer, not the whole model, per bucket.
            for region in regions:
                region.compile(backend=self._counting_backend, dynamic=False)
            self._compiled = forward
        else:
            self._compiled = torch.compile(forward, backend=self._counting_backend,
                                           dynamic=False)

    def _counting_backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.counters.compiled(self._phase)
        logger.debug("compiling %s graph (%d nodes)", self._phase, len(gm.graph.nodes))
        if self._backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self._backend)(gm, example_inputs)

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        self._phase = phase
        return self._compiled(inputs)
