import pytest

from server.engine.core.block_manager import BlockManager, blocks_for
from server.engine.core.sequence import Sequence
from server.engine.sampling_params import SamplingParams


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(num_tokens)), SamplingParams(), 0.0)


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_allocate_append_free_roundtrip() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 5)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 2
    assert bm.num_free_blocks == 2
    # tokens 5..8 fit in the second block; the 9th token needs a third
    for _ in range(3):
        seq.output_token_ids.append(1)
        assert bm.can_append(seq)
        bm.append_slot(seq)
        assert len(seq.block_table) == 2
    seq.output_token_ids.append(1)
    bm.append_slot(seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 1
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.0


def test_pad_block_is_never_handed_out() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    seqs = [make_seq(i, 2) for i in range(3)]
    for seq in seqs:
        bm.allocate(seq)
    handed = {b for s in seqs for b in s.block_table}
    assert handed == {0, 1, 2}
    assert bm.pad_block_id == 3
    assert not bm.can_allocate(make_seq(8, 1))
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(9, 1))


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), 0.0)


def run(bm: BlockManager, seq: Sequence) -> None:
    """Allocate, then publish what a prefill step wrote."""
    bm.allocate(seq)
    bm.cache_blocks(seq, seq.num_tokens)


def test_shared_prefix_blocks_are_reused_and_reference_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    prefix = [7, 8, 9, 10, 11, 12, 13, 14]  # two full blocks
    a = seq_of(0, prefix + [1, 2])
    run(bm, a)
    assert a.num_cached_tokens == 0
    b = seq_of(1, prefix + [3])
    assert bm.num_cached_tokens(b) == 8
    run(bm, b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]  # shared
    assert b.block_table[2] != a.block_table[2]
    assert bm.num_free_blocks == 8 - 4  # 3 of a's + 1 new of b's
    assert (bm.stats.queries, bm.stats.hits) == (10 + 9, 8)
    bm.free(a)
    assert bm.num_free_blocks == 5  # the shared blocks still belong to b
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    # freed named blocks stay reusable until the pool needs them
    c = seq_of(2, prefix + [5, 6, 7])
    assert bm.num_cached_tokens(c) == 8


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=True)
    run(bm, seq_of(0, list(range(8))))
    again = seq_of(1, list(range(8)))
    assert bm.num_cached_tokens(again) == 4  # not 8: the step needs one token's logits


def test_eviction_takes_the_least_recently_freed_and_forgets_its_name() -> None:
    bm = BlockManager(num_blocks=2, block_size=2, enable_caching=True)
    old, new = seq_of(0, [1, 2, 3]), seq_of(1, [4, 5, 6])
    run(bm, old)  # blocks: [1, 2] named, [3] partial
    bm.free(old)
    assert bm.num_cached_tokens(seq_of(9, [1, 2, 9])) == 2
    run(bm, new)  # needs both blocks: evicts old's named block
    assert bm.num_cached_tokens(seq_of(9, [1, 2, 9])) == 0
    bm.free(new)
    assert bm.num_free_blocks == 2


def test_chained_names_distinguish_equal_blocks_after_different_prefixes() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    run(bm, seq_of(0, [1, 2, 3, 4, 0]))
    # block [3, 4] after [9, 9] is another prefix: no hit past the first block
    assert bm.num_cached_tokens(seq_of(1, [9, 9, 3, 4, 0])) == 0
    assert bm.num_cached_tokens(seq_of(2, [1, 2, 3, 4, 5])) == 4


def test_reset_and_disabled_caching() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    seq = seq_of(0, [1, 2, 3, 4, 5])
    run(bm, seq)
    bm.free(seq)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_tokens(seq_of(1, [1, 2, 3, 4, 5])) == 0
    assert bm.num_free_blocks == 4
    off = BlockManager(num_blocks=4, block_size=2)
    run(off, seq_of(0, [1, 2, 3]))
    assert off.num_cached_tokens(seq_of(1, [1, 2, 3])) == 0
    assert off.stats.queries == 0
