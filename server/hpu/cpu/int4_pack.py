"""4-bit weights prepacked for ``torch.ops.hpu_serve.int4_linear`` (csrc/int4_gemm.cpp).

The kernel reads a weight once per call whatever its row count and gives each row the same
bits at 1 row or 16 (see the kernel's header), so a speculative verify step costs little
more than one decode step and scores its drafts with plain decoding's numerics. Scales and
zeros stay float32: GGUF's fp16 block scales (and Q4_1's ``m + 8d``) keep every bit, where
aten's int4 kernel takes them in the activation dtype (bf16 keeps 8 of fp16's 11 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from server.hpu.cpu.host_memory import on_huge_pages

TILE = 16  # output columns per kernel vector


@dataclass(frozen=True, slots=True)
class PackedInt4:
    """``weight`` uint8 ``[tiles, K / group, block]``: per 16 output columns and input
    group, the codes (``group / 2`` bytes, see the kernel's header) then the 16 columns'
    float32 scales and zeros (``block = group * 8 + 128``), or scales only where every zero
    is 0 (``group * 8 + 64``)."""

    weight: torch.Tensor
    group_size: int
    out_features: int


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PackedInt4:
    """Codes ``[N, K]`` (0..15, ``w = (code - 8) * scale + zero``), scale / zero
    ``[N, K // group]`` -> the kernel's layout (N padded to a multiple of 16 with zeros)."""
    n, k = codes.shape
    groups = scale.shape[1]
    if groups == 0 or k % groups or (k // groups) % 4 or zero.shape != scale.shape:
        raise ValueError(f"int4 weight [{n}, {k}] with {groups} groups per row: the kernel "
                         "needs groups of a multiple of 4 inputs that divide the row")
    group = k // groups
    pad = -n % TILE
    tiles = (n + pad) // TILE
    # byte 2j + e of quad r: column j's codes for inputs 4r + e (low) and 4r + 2 + e (high)
    q = F.pad(codes.to(torch.uint8), (0, 0, 0, pad)).view(tiles, TILE, groups, group // 4, 4)
    q = (q[..., 0:2] | (q[..., 2:4] << 4)).permute(0, 2, 3, 1, 4)
    parts = [scale] if not torch.any(zero) else [scale, zero]
    sz = torch.stack([F.pad(p.float(), (0, 0, 0, pad)) for p in parts], dim=-1)
    sz = sz.view(tiles, TILE, groups, len(parts)).permute(0, 2, 3, 1).contiguous()
    weight = torch.cat([q.reshape(tiles, groups, -1),
                        sz.view(torch.uint8).reshape(tiles, groups, -1)], dim=-1)
    return PackedInt4(on_huge_pages(weight), group, n)


def int4_linear(x: torch.Tensor, weight: PackedInt4,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W^T`` over the last dim of a contiguous bfloat16 ``x``, in bfloat16 (or the fp32
    accumulators, ``out_dtype=torch.float32``)."""
    return torch.ops.hpu_serve.int4_linear(x, weight.weight, weight.group_size,
                                           weight.out_features, out_dtype)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops, "hpu_serve") and hasattr(torch.ops.hpu_serve, "int4_linear")
