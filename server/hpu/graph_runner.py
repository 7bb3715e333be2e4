"""Executing the model on pre-planned shapes: one small interface, one backend per mode.

``run(phase, bucket, inputs)`` executes a padded batch; ``warm`` compiles that shape ahead
of serving and ``capture`` records a replayable device graph of it (runners that capture).
The runner is handed the forward as a plain callable of :class:`ForwardInputs`: it knows
nothing of models or requests. Platforms bring their own runners (``cuda.py``,
``gaudi.py``); eager and ``torch.compile`` live here.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from server.config import ExecutionMode
from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters
from server.hpu.types import Bucket, Phase

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardInputs:
    """Device tensors of one padded batch; every shape is fixed by its bucket."""

    input_ids: torch.Tensor  # [bs, q]
    positions: torch.Tensor  # [bs, q]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [bs] flat index of each row's last token (pads: 0)
    num_seqs: int  # real rows; the rest is padding


ForwardFn = Callable[[ForwardInputs], torch.Tensor]


class GraphRunner(ABC):
    """Runs ``forward`` for padded batches; subclasses decide how shapes become graphs."""

    mode: ClassVar[ExecutionMode]
    # What the warmup log calls it ("CUDA graphs", "torch.compile (inductor)"...).
    description: ClassVar[str]
    # Whether running a shape the first time compiles something, so warmup must run every
    # bucket before serving (false only for plain eager PyTorch).
    needs_warmup: ClassVar[bool] = True
    # Whether warmup should capture graphs (within VLLM_GRAPH_RESERVED_MEM) after warming.
    captures_graphs: ClassVar[bool] = False

    def __init__(self, forward: ForwardFn, counters: DeviceCounters) -> None:
        self.forward = forward
        self.counters = counters
        self.warmed: dict[Phase, set[Bucket]] = {Phase.PREFILL: set(), Phase.DECODE: set()}

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

    def sync(self, phase: str) -> None:
        """Ends the device work issued since the last step (sampling, on a device that
        queues ops lazily) and counts what that compiled under ``phase``."""
        del phase


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
