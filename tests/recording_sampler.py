"""The engine's sampler, wrapped to keep every step's logits for comparison with a reference."""

from __future__ import annotations

import torch


class RecordingSampler:
    """Rank 0's sampler, keeping a host copy of each step's logits: the reference model runs
    on the CPU, and the engine may run on an accelerator."""

    def __init__(self, inner) -> None:  # noqa: ANN001 - server.engine.worker.sampler.Sampler
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, t):  # noqa: ANN001, ANN204
        self.logits.append(logits.detach().float().cpu().clone())
        return self.inner(logits, t)
