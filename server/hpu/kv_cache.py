"""Physical KV cache tensors and how many blocks fit in the budget."""

from __future__ import annotations

import torch

# One layer's K and V, each ``[num_blocks + 1, Hkv, block_size, D]`` (see attention.py).
KVCache = tuple[torch.Tensor, torch.Tensor]


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
) -> list[KVCache]:
    """Per layer, K and V as ``[num_blocks + 1, Hkv, block_size, D]`` (see attention.py).

    The extra block (id ``num_blocks``) is the padding block. Zero-filled because masked
    slots still flow through matmuls: uninitialised NaNs would poison them (0 * NaN).
    """
    shape = (num_blocks + 1, num_kv_heads, block_size, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, useful_blocks: int,
                  needed_blocks: int) -> int:
    """Blocks that fit the budget (one is kept for padding), at most ``useful_blocks``;
    fails when fewer than ``needed_blocks`` (one sequence of max_model_len) fit."""
    num_blocks = min(budget_bytes // bytes_per_block - 1, useful_blocks)
    if num_blocks < needed_blocks:
        raise RuntimeError(
            f"KV cache budget ({budget_bytes / 2**30:.2f} GiB) holds {max(num_blocks, 0)} "
            f"blocks, fewer than the {needed_blocks} one sequence of max_model_len needs; "
            "raise the budget (VLLM_CPU_KVCACHE_SPACE / --gpu-memory-utilization) "
            "or lower --max-model-len"
        )
    return num_blocks
