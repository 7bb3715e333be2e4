"""Physical KV cache tensors and how many blocks fit in the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One layer's K and V, each ``[num_blocks + 1, Hkv, block_size, D]`` (see attention.py). A
# layout with shared K/V (multi-head latent attention) holds one tensor, twice.
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """What one token leaves in each layer's cache: ``num_heads`` vectors of ``head_dim``
    for the keys and as many for the values, or, with ``shared_kv``, one set serving as both
    (DeepSeek's multi-head latent attention caches the compressed latent and its RoPE key,
    ``kv_lora_rank + qk_rope_head_dim`` values, which the attention reads as keys and
    values at once). The model config decides it (``ModelConfig.kv_layout``); sizing and
    allocation read nothing else."""

    num_layers: int
    num_heads: int
    head_dim: int
    shared_kv: bool = False

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.shared_kv else 2

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return (self.tensors_per_layer * self.num_layers * self.num_heads * self.head_dim
                * element)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> list[KVCache]:
        """Per layer, K and V as ``[num_blocks + 1, H, block_size, D]`` (one tensor as both
        with ``shared_kv``).

        The extra block (id ``num_blocks``) is the padding block. Zero-filled because masked
        slots still flow through matmuls: uninitialised NaNs would poison them (0 * NaN).
        """
        shape = (num_blocks + 1, self.num_heads, block_size, self.head_dim)
        caches: list[KVCache] = []
        for _ in range(self.num_layers):
            k = _zeros(shape, dtype, device)
            caches.append((k, k) if self.shared_kv else (k, _zeros(shape, dtype, device)))
        return caches

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the start-up log."""
        element = torch.empty((), dtype=dtype).element_size()
        what = (f"latent {self.head_dim} values, keys and values at once" if self.shared_kv
                else f"K and V, {self.num_heads} heads x {self.head_dim}")
        parts = f"{self.num_layers} layers x " + (
            f"{self.head_dim}" if self.shared_kv
            else f"2 x {self.num_heads} x {self.head_dim}")
        return (f"{self.bytes_per_token(dtype)} bytes per token ({parts} x {element} bytes; "
                f"{what})")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # a decode step reads every running sequence's blocks: on 2 MiB pages where the host
    # gives them (see host_memory.py), advised before the zero fill touches them
    from server.hpu.cpu.host_memory import empty_on_huge_pages

    return empty_on_huge_pages(shape, dtype).zero_()


def cache_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of the distinct tensors of the caches (a shared K/V tensor counts once)."""
    seen = {id(t): t for layer in kv_caches for t in layer}
    return sum(t.numel() * t.element_size() for t in seen.values())


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    return KVCacheLayout(num_layers, num_kv_heads, head_dim).bytes_per_block(block_size, dtype)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[KVCache]:
    """Separate K and V per layer (see :meth:`KVCacheLayout.allocate`)."""
    return KVCacheLayout(num_layers, num_kv_heads, head_dim).allocate(
        num_blocks, block_size, dtype, device)


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
