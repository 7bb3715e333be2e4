"""bfloat16 weights prepacked for ``torch.ops.hpu_serve.bf16_linear`` (csrc/bf16_gemm.cpp).

The kernel serves the few rows of a decode or verify step with each row's result the same
bits whatever the row count, so a speculative verify step scores its drafts exactly as a
plain decode step would (oneDNN's GEMM rounds a row differently at 1 row and at k + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.hpu.cpu.host_memory import on_huge_pages

TILE = 16  # output columns per kernel vector


@dataclass(frozen=True, slots=True)
class PackedBf16:
    """``weight`` bfloat16 ``[tiles, ceil(K / 2), 16, 2]``: per 16 output columns, one
    64-byte vector per input pair (N padded to a multiple of 16, K to even, with zeros);
    ``bias`` float32 or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedBf16:
    """A ``[N, K]`` weight (any float dtype, rounded to bfloat16) -> the kernel's layout."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    if k % 2 or n % TILE:
        w = F.pad(w, (0, k % 2, 0, -n % TILE))
    tiles, half = w.shape[0] // TILE, w.shape[1] // 2
    # input pairs as int32, transposed as they are copied to huge pages: one pass over the
    # weight with 4-byte elements (a GGUF engine's start packs 256 MiB for SmolLM2; the
    # bf16 permute and its copy took 2x as long)
    pairs = w.contiguous().view(torch.int32).view(tiles, TILE, half).transpose(1, 2)
    packed = on_huge_pages(pairs).view(torch.bfloat16).view(tiles, half, TILE, 2)
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedBf16(packed, b, n)


def bf16_linear(x: torch.Tensor, weight: PackedBf16,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W^T + b`` over the last dim of a bfloat16 ``x``, in bfloat16 (or the fp32
    accumulators, ``out_dtype=torch.float32``)."""
    return torch.ops.hpu_serve.bf16_linear(x, weight.weight, weight.bias, weight.out_features,
                                           out_dtype)


def bf16_kernel_available() -> bool:
    return hasattr(torch.ops, "hpu_serve") and hasattr(torch.ops.hpu_serve, "bf16_linear")
