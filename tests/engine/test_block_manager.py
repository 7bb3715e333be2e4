import pytest

from server.engine.block_manager import BlockManager, blocks_for
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(num_tokens)), SamplingParams(), 0.0)


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_allocate_append_free_roundtrip() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 5)
    assert bm.can_allocate(5)
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
    assert not bm.can_allocate(1)
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(9, 1))
