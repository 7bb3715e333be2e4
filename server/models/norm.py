"""RMSNorm, shared by every decoder family (a leaf: attention variants in their own modules
use it without importing the Llama decoder)."""

from __future__ import annotations

import torch
from torch import nn

from server.hpu.layer_ops import TorchLayerOps

_TORCH_OPS = TorchLayerOps()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops: TorchLayerOps = _TORCH_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with a residual stream ``(norm(residual + x), residual + x)``."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
