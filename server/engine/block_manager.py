"""Paged KV block pool: which physical blocks each sequence owns. Pure Python."""

from __future__ import annotations

from collections import deque

from server.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks ``0 .. num_blocks-1``.

    Block ``num_blocks`` (``pad_block_id``) exists in the cache tensors but is never handed
    out: padding tokens write into it and padding entries read from it, so no index is ever
    negative or out of range.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block_id = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of ``seq`` (a prefill writes them all)."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        needed = blocks_for(seq.num_tokens, self.block_size)
        if needed > len(self._free):
            raise RuntimeError("allocate() without can_allocate()")
        seq.block_table = [self._free.popleft() for _ in range(needed)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step (which writes token ``num_tokens - 1``) fits."""
        return self._missing(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        for _ in range(self._missing(seq)):
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

    def _missing(self, seq: Sequence) -> int:
        return max(0, blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table))
