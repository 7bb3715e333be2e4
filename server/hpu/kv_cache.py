"""Physical KV cache tensors and how many blocks fit in the budget."""

from __future__ import annotations

import torch


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V as ``[num_blocks + 1, Hkv, block_size, D]`` (see attention.py).

    The extra block (id ``num_blocks``) is the padding block. Zero-filled because masked
    slots still flow through matmuls: uninitialised NaNs would poison them (0 * NaN).
    """
    shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
