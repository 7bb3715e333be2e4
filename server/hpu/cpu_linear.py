"""Linear layers with weights pre-packed in oneDNN's blocked layout, for eager CPU serving.

A plain ``F.linear`` on CPU hands oneDNN a row-major weight, which it re-blocks on every
call; decode GEMMs are skinny (a few rows against a large weight), so that per-call work is
a large share of the step. Packing once at load time removes it (measured on the SmolLM2
linear stack: 1.2x at 1 row, 1.5-1.9x at 16-32 rows, bf16 results bit-identical). This is
the same packing inductor applies when it freezes a CPU graph, so only eager mode needs it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN present, the dtype one it packs, and bf16 only where the CPU computes it."""
    if dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as an opaque oneDNN tensor (not a parameter)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # The batch-size hint only picks the blocking; measured equally fast from 1 to 256
        # rows with hint 1, so decode's small batches get the tuned layout.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_numel = weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear`, in place.

    Returns how many were packed; 0 (model untouched) where this torch build or CPU cannot.
    Tied weights stay intact: the embedding keeps the dense tensor, the head gets a packed
    copy.
    """
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not packing_supported(linears[0][1].weight.dtype):
        return 0
    if any(m.weight.device.type != "cpu" for _, m in linears):
        return 0
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear))
    logger.info("Packed %d linear layers into oneDNN's blocked layout", len(linears))
    return len(linears)
