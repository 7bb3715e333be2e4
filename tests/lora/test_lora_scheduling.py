"""Adapters and the scheduler / prefix cache, with no model: never more distinct adapters
running than slots (a request waits, later ones may pass), and block hashes that differ per
adapter."""

from __future__ import annotations

from server.config import SchedulerLimits
from server.engine.core.block_manager import BlockManager
from server.engine.core.scheduler import Scheduler
from server.engine.core.sequence import Sequence
from server.engine.lora.request import LoRARequest
from server.engine.sampling_params import SamplingParams


def _seq(seq_id: int, lora: int | None, tokens: list[int] | None = None) -> Sequence:
    request = None if lora is None else LoRARequest(f"l{lora}", lora, "/x")
    return Sequence(seq_id, f"r{seq_id}", 0, tokens or [1] * 8, SamplingParams(),
                    float(seq_id), lora=request)


def test_a_third_adapter_waits_while_two_slots_are_busy() -> None:
    sched = Scheduler(SchedulerLimits(8, 256, 64, chunked_prefill=False),
                      BlockManager(64, 4), max_loras=2)
    for seq in (_seq(0, 1), _seq(1, 2), _seq(2, 3), _seq(3, None), _seq(4, 1)):
        sched.add(seq)
    [batch] = sched.schedule()
    # adapter 3 waits; the base request and a second adapter-1 request pass it
    assert [s.seq_id for s in batch.seqs] == [0, 1, 3, 4]
    assert [s.seq_id for s in sched.waiting] == [2]
    assert sched.running_loras() == {1, 2}
    for seq in list(sched.running):
        if seq.lora is not None and seq.lora.lora_int_id == 2:
            sched.finish(seq)
    [batch] = sched.schedule()  # a slot is free: it runs now
    assert [s.seq_id for s in batch.seqs] == [2]
    assert len(sched.running_loras()) == 2


def test_two_adapters_never_share_cached_blocks() -> None:
    tokens = list(range(20))
    bm = BlockManager(32, 4, enable_caching=True)
    first = _seq(0, 1, tokens)
    bm.allocate(first)
    bm.cache_blocks(first, len(tokens))
    assert bm.num_cached_tokens(_seq(1, 1, tokens)) == 16  # same adapter: shared
    assert bm.num_cached_tokens(_seq(2, 2, tokens)) == 0  # another adapter: nothing
    assert bm.num_cached_tokens(_seq(3, None, tokens)) == 0  # nor the base model
