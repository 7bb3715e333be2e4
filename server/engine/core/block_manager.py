"""Paged KV block pool with automatic prefix caching: which physical blocks each sequence
owns, and which full blocks hold a known token prefix. Pure Python.

A full block is named by a chained hash: its parent block's hash plus its own token ids, so
equal hashes mean equal whole prefixes. Blocks are reference-counted; a block whose last
owner leaves keeps its contents and its name, in least-recently-freed order, until the pool
needs it back. A new sequence takes over the longest named prefix of its tokens (always
leaving at least one token to compute: the step must produce logits) and computes the rest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from server.engine.core.sequence import Sequence
from server.engine.multimodal.inputs import block_images


def chain_root(cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """Where a sequence's chain of block hashes starts: the request's ``cache_salt`` and its
    LoRA adapter go into the first block's name (so every later one's), as vLLM's extra keys
    do: two adapters never share K/V (the same tokens give other keys and values)."""
    if cache_salt is None and lora_id is None:
        return b""
    h = hashlib.sha256()
    if cache_salt is not None:
        h.update(b"cache_salt\0" + cache_salt.encode("utf-8"))
    if lora_id is not None:
        h.update(b"\0lora\0" + str(lora_id).encode())
    return h.digest()


def seq_root(seq: Sequence) -> bytes:
    return chain_root(seq.params.cache_salt, seq.lora.lora_int_id if seq.lora else None)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class AllocationPlan:
    """What allocating a sequence now would take: its cached prefix and the new blocks."""

    hits: list[int]  # blocks of its longest cached prefix
    needed: int  # new blocks for the rest
    fits: bool
    block_size: int

    @property
    def num_cached_tokens(self) -> int:
        return len(self.hits) * self.block_size


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative token counts (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``)."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    """Hands out fixed-size KV blocks ``0 .. num_blocks-1``.

    Block ``num_blocks`` (``pad_block_id``) exists in the cache tensors but is never handed
    out: padding tokens write into it and padding entries read from it, so no index is ever
    negative or out of range.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block_id = num_blocks
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # blocks in use -> owners
        self._by_hash: dict[bytes, int] = {}  # named full blocks
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unowned: LRU first
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get: unused ones and cached ones nobody owns."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def plan(self, seq: Sequence) -> AllocationPlan:
        """The allocation of ``seq`` as things stand (valid until the pool changes): one
        lookup of its prefix, for the scheduler's checks and the allocation alike."""
        hits, in_pool = self._prefix_hits(seq)
        needed = blocks_for(seq.num_tokens, self.block_size) - len(hits)
        return AllocationPlan(hits, needed, needed <= self.num_free_blocks - in_pool,
                              self.block_size)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` an allocation now would find cached."""
        return self.plan(seq).num_cached_tokens

    def can_allocate(self, seq: Sequence) -> bool:
        return self.plan(seq).fits

    def allocate(self, seq: Sequence, plan: AllocationPlan | None = None) -> None:
        """Blocks for every token of ``seq``: its cached prefix shared, the rest new; sets
        ``seq.num_cached_tokens`` (what the prefill may skip). ``plan``: this very pool's
        ``plan(seq)``, when the caller just made it."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        plan = plan or self.plan(seq)
        if not plan.fits:
            raise RuntimeError("allocate() without can_allocate()")
        for block in plan.hits:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        hits = plan.hits
        seq.block_table = hits + [self._take() for _ in range(plan.needed)]
        seq.block_hashes = [self._hash_of[b] for b in hits]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens
        if self.enable_caching:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence, extra: int = 0) -> bool:
        """Whether the next decode step (which writes token ``num_tokens - 1``, and
        ``extra`` draft tokens after it) fits."""
        return self._missing(seq, extra) <= self.num_free_blocks

    def append_slot(self, seq: Sequence, extra: int = 0) -> None:
        for _ in range(self._missing(seq, extra)):
            seq.block_table.append(self._take())

    def trim(self, seq: Sequence, extra: int = 0) -> None:
        """Gives back the blocks past what ``seq``'s tokens (and ``extra`` draft tokens
        after them) need: the ones only rejected or unproposed drafts were for (never
        named: they were past the computed tokens)."""
        keep = blocks_for(seq.num_tokens + extra, self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            refs = self._refs.pop(block) - 1
            if refs > 0:
                self._refs[block] = refs
            elif block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def cache_blocks(self, seq: Sequence, num_written: int) -> None:
        """Names the blocks the first ``num_written`` tokens of ``seq`` filled (call once
        the step that wrote them succeeded: a failed step must not publish its blocks)."""
        if not self.enable_caching:
            return
        tokens = seq.all_token_ids
        size = self.block_size
        root = seq_root(seq)
        for i in range(len(seq.block_hashes), num_written // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else root
            digest = block_hash(parent, tokens[i * size:(i + 1) * size],
                                block_images(seq.images, i * size, (i + 1) * size))
            seq.block_hashes.append(digest)
            block = seq.block_table[i]
            if digest not in self._by_hash and block not in self._hash_of:
                self._by_hash[digest] = block
                self._hash_of[block] = digest

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            refs = self._refs.pop(block) - 1
            if refs > 0:
                self._refs[block] = refs
            elif block in self._hash_of:
                self._evictable[block] = None  # most recently freed last
            else:
                self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0  # its K/V may be overwritten from now on

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (``POST /reset_prefix_cache``); returns how many
        blocks were named. Blocks in use keep their contents for their owners."""
        count = len(self._by_hash)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_hash.clear()
        self._hash_of.clear()
        return count

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], int]:
        """(blocks of ``seq``'s longest cached prefix, how many of them sit in the pool)."""
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            # prompt logprobs need the logits of every prompt position, which a cached
            # prefix never computed: such a request reads no cache (vLLM's choice), and
            # still publishes its blocks for others
            return [], 0
        tokens = seq.all_token_ids
        size = self.block_size
        usable = (len(tokens) - 1) // size  # at least one token left to compute
        hits: list[int] = []
        parent = seq_root(seq)
        for i in range(usable):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size],
                                block_images(seq.images, i * size, (i + 1) * size))
            block = self._by_hash.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits, sum(1 for b in hits if b in self._evictable)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # the least recently freed cached block gives up its name
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def _missing(self, seq: Sequence, extra: int = 0) -> int:
        return max(0, blocks_for(seq.num_tokens + extra, self.block_size)
                   - len(seq.block_table))


def block_hash(parent: bytes, tokens: list[int], images: bytes = b"") -> bytes:
    """A full block's name: its whole prefix, through the parent's name (sha256: a collision
    would hand one request another's keys and values); ``images``: the hashes of the images
    whose placeholder tokens it holds (the same tokens stand for any image)."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    if images:
        h.update(b"\0images\0" + images)
    return h.digest()
