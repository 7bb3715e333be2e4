"""GGUF Q8_0 weights prepacked for ``torch.ops.hpu_serve.q8_linear`` (csrc/q8_gemm.cpp).

For a GGUF's Q8_0 LM head: the codes and their per-32 scales are 32 MB for SmolLM2's head
where the dequantized bf16 copy is 57 MB, and a decode step at a few rows is bound by reading
it. Like the int4 kernel's, a row's result is the same bits at 1 row or 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.hpu.cpu.host_memory import on_huge_pages

TILE = 16  # output columns per kernel vector
GROUP = 32  # inputs per scale: GGUF's Q8_0 block


@dataclass(frozen=True, slots=True)
class PackedQ8:
    """``weight`` uint8 ``[tiles, K / 32, 576]``: per 16 output columns and group of 32
    inputs, the codes (512 bytes, see the kernel's header) then the 16 columns' float32
    scales."""

    weight: torch.Tensor
    out_features: int


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> PackedQ8:
    """Codes int8 ``[N, K]`` (``w = code * scale``), scale ``[N, K // 32]`` -> the kernel's
    layout (N padded to a multiple of 16 with zeros)."""
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP):
        raise ValueError(f"Q8_0 weight [{n}, {k}] with scales {tuple(scale.shape)}: the kernel "
                         "needs one scale per 32 inputs")
    pad = -n % TILE
    tiles, groups = (n + pad) // TILE, k // GROUP
    # byte 2c + e of pair j: column c's code for input 2j + e
    q = F.pad(codes.view(torch.uint8), (0, 0, 0, pad)).view(tiles, TILE, groups, GROUP // 2, 2)
    q = q.permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    s = F.pad(scale.float(), (0, 0, 0, pad)).view(tiles, TILE, groups).permute(0, 2, 1)
    weight = torch.cat([q, s.contiguous().view(torch.uint8).reshape(tiles, groups, -1)], dim=-1)
    return PackedQ8(on_huge_pages(weight), n)


def q8_linear(x: torch.Tensor, weight: PackedQ8,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W^T`` over the last dim of a contiguous bfloat16 ``x``, in bfloat16 (or the fp32
    accumulators, ``out_dtype=torch.float32``)."""
    return torch.ops.hpu_serve.q8_linear(x, weight.weight, weight.out_features, out_dtype)


def q8_kernel_available() -> bool:
    return hasattr(torch.ops, "hpu_serve") and hasattr(torch.ops.hpu_serve, "q8_linear")
