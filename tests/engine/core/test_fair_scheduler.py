"""Fair share in the scheduler (``SchedulerLimits.fair_share``): round-robin admission over
clients, the client holding the most gives way, no thrashing, and one client schedules
exactly as FCFS does. CPU only, no model: one fake token per step."""

from __future__ import annotations

import dataclasses
import random

import pytest

from server.config import SchedulerLimits
from server.engine.core.block_manager import BlockManager
from server.engine.core.fair_share import MIN_STEPS_BEFORE_FAIR_PREEMPTION
from server.engine.core.scheduler import Scheduler
from server.engine.core.sequence import ScheduledBatch, Sequence, SequenceStatus
from server.engine.sampling_params import SamplingParams
from server.hpu.types import Phase
from tests.engine.core.test_scheduler import fake_step, fake_steps


def make_fair(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 4,
              max_batched: int = 256, fair: bool = True, chunked: bool = False,
              policy: str = "fcfs") -> Scheduler:
    limits = SchedulerLimits(max_num_seqs, max_batched, 128, policy=policy,
                             chunked_prefill=chunked, fair_share=fair)
    return Scheduler(limits, BlockManager(num_blocks, block_size))


def seq(seq_id: int, client: str, num_tokens: int = 4, request: str | None = None,
        priority: int = 0, arrival: float | None = None) -> Sequence:
    return Sequence(seq_id, request or f"r{seq_id}", 0, [1] * num_tokens,
                    SamplingParams(priority=priority),
                    float(seq_id) if arrival is None else arrival, client=client)


def ids(seqs: list[Sequence]) -> list[int]:
    return [s.seq_id for s in seqs]


def running_by(sched: Scheduler, client: str) -> int:
    return sum(1 for s in sched.running if s.client == client)


def test_admission_round_robins_over_clients() -> None:
    sched = make_fair(max_num_seqs=4)
    for i in range(4):
        sched.add(seq(i, "A"))  # A came first with four
    sched.add(seq(4, "B"))
    sched.add(seq(5, "B"))
    batch = fake_step(sched)
    assert ids(batch.seqs) == [0, 4, 1, 5]  # alternating, ties by arrival
    assert ids(sched.waiting) == [2, 3]
    fcfs = make_fair(max_num_seqs=4, fair=False)
    for i, c in enumerate("AAAABB"):
        fcfs.add(seq(i, c))
    assert ids(fake_step(fcfs).seqs) == [0, 1, 2, 3]  # today's order without fair share


def test_a_requests_sequences_are_admitted_together() -> None:
    sched = make_fair(max_num_seqs=8)
    for i in range(3):  # one request, n=3
        sched.add(seq(i, "A", request="rA", arrival=0.0))
    sched.add(seq(3, "B", arrival=1.0))
    sched.add(seq(4, "A", arrival=2.0))
    assert ids(fake_step(sched).seqs) == [0, 1, 2, 3, 4]


def run_steps(sched: Scheduler, steps: int) -> list[ScheduledBatch]:
    batches = []
    for _ in range(steps):
        batches += fake_steps(sched)
    return batches


def test_the_client_holding_most_gives_way_after_its_grace_and_no_thrashing() -> None:
    sched = make_fair(max_num_seqs=5, num_blocks=512)
    for i in range(8):
        sched.add(seq(i, "A"))
    run_steps(sched, 2)
    assert running_by(sched, "A") == 5
    for i in range(10, 14):
        sched.add(seq(i, "B"))
    # A's sequences are still within their grace (admitted 2 steps ago): nobody is preempted
    batches = run_steps(sched, MIN_STEPS_BEFORE_FAIR_PREEMPTION - 3)
    assert not any(b.preempted for b in batches)
    assert running_by(sched, "B") == 0
    batches = run_steps(sched, 3)
    preempted = [s for b in batches for s in b.preempted]
    # two of A's give way, the newest first; then A holds 3 and B 2: a third swap would
    # leave B holding more than A, and A would then take it back
    assert ids(preempted) == [4, 3]
    assert running_by(sched, "A") == 3 and running_by(sched, "B") == 2
    assert all(s.status is SequenceStatus.WAITING for s in preempted)
    batches = run_steps(sched, 60)
    assert not any(b.preempted for b in batches)  # nothing traded back and forth
    assert sched.num_fair_preemptions == 2


def test_a_returning_sequence_is_not_preempted_at_once() -> None:
    sched = make_fair(max_num_seqs=3)
    for i in range(3):
        sched.add(seq(i, "A"))
    run_steps(sched, MIN_STEPS_BEFORE_FAIR_PREEMPTION + 1)
    sched.add(seq(10, "B"))
    batches = run_steps(sched, 1)
    assert ids([s for b in batches for s in b.preempted]) == [2]  # A: 2 running, B: 1
    b_seq = next(s for s in sched.running if s.client == "B")
    sched.finish(b_seq)  # B is done; A's sequence comes back at once
    run_steps(sched, 1)
    assert running_by(sched, "A") == 3
    sched.add(seq(11, "B"))  # B again: A's returning sequence (2) keeps its grace
    batches = run_steps(sched, 1)
    assert ids([s for b in batches for s in b.preempted]) == [1]  # the newest eligible
    assert sched.num_fair_preemptions == 2


def test_kv_blocks_full_preempts_the_biggest_client_for_the_waiting_one() -> None:
    # 8 blocks of 4 tokens: A's two 16-token prompts hold all of them; the batch has slots
    sched = make_fair(num_blocks=8, block_size=4, max_num_seqs=8)
    sched.add(seq(0, "A", num_tokens=15))
    sched.add(seq(1, "A", num_tokens=15))
    sched.add(seq(2, "A", num_tokens=15))
    run_steps(sched, MIN_STEPS_BEFORE_FAIR_PREEMPTION + 1)
    sched.add(seq(3, "B", num_tokens=6))
    batches = run_steps(sched, 2)
    assert any(s.seq_id == 3 for b in batches for s in b.seqs if b.phase is Phase.PREFILL)
    assert running_by(sched, "B") == 1


def test_decode_block_shortage_preempts_from_the_client_holding_most() -> None:
    # 6 blocks of 2: A (2 sequences) and B (1), all of 4 tokens, need a 3rd block each
    sched = make_fair(num_blocks=6, block_size=2, max_num_seqs=4)
    sched.add(seq(0, "B"))
    sched.add(seq(1, "A"))
    sched.add(seq(2, "A"))
    fake_step(sched)
    batch = fake_step(sched)
    assert batch.phase is Phase.DECODE
    # FCFS would take the newest (2); fair share takes A's newest as well: A holds more
    assert ids(batch.preempted) == [2]
    sched2 = make_fair(num_blocks=6, block_size=2, max_num_seqs=4)
    sched2.add(seq(0, "A"))
    sched2.add(seq(1, "A"))
    sched2.add(seq(2, "B"))  # the newest, but B holds one: A's newest gives way
    fake_step(sched2)
    assert ids(fake_step(sched2).preempted) == [1]


def test_priority_comes_before_fairness() -> None:
    sched = make_fair(max_num_seqs=4, policy="priority")
    for i in range(4):
        sched.add(seq(i, "A", priority=-1))  # urgent
    sched.add(seq(4, "B", priority=5))
    sched.add(seq(5, "C", priority=-1))
    batch = fake_step(sched)
    assert ids(batch.seqs) == [0, 5, 1, 2]  # the urgent level first, round-robin inside it
    run_steps(sched, MIN_STEPS_BEFORE_FAIR_PREEMPTION + 2)
    assert running_by(sched, "B") == 0  # never preempts a more urgent sequence for B
    assert sched.num_fair_preemptions == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_prefill_admits_fairly_and_preempts_outside_the_decode(chunked: bool) -> None:
    sched = make_fair(max_num_seqs=4, chunked=chunked, max_batched=64)
    for i in range(6):
        sched.add(seq(i, "A", num_tokens=10))
    run_steps(sched, MIN_STEPS_BEFORE_FAIR_PREEMPTION + 1)
    sched.add(seq(9, "B", num_tokens=10))
    for _ in range(3):
        batches = fake_steps(sched)
        gone = {id(s) for b in batches for s in b.preempted}
        assert not any(id(s) in gone for b in batches for s in b.seqs)
    assert running_by(sched, "B") == 1


def test_abort_keeps_client_queues_in_step() -> None:
    sched = make_fair(max_num_seqs=1)
    sched.add(seq(0, "A"))
    sched.add(seq(1, "A", request="x"))
    sched.add(seq(2, "B", request="x"))
    fake_step(sched)
    sched.abort("x")
    assert ids(sched.waiting) == []
    assert len(sched._queues) == 0
    sched.abort("r0")
    assert not sched.has_unfinished()


def _workload(seed: int, client: str | list[str]) -> list[tuple[int, Sequence]]:
    rng = random.Random(seed)
    out = []
    for i in range(40):
        who = client if isinstance(client, str) else rng.choice(client)
        s = Sequence(i, f"r{i // 2}", i % 2, [1] * rng.randint(1, 20),
                     SamplingParams(priority=rng.randint(0, 2)), float(i // 2), client=who)
        out.append((rng.randint(0, 30), s))
    return out


def _trace(sched: Scheduler, workload: list[tuple[int, Sequence]]) -> list[tuple]:
    pending = [(t, dataclasses.replace(s, output_token_ids=[], block_table=[], block_hashes=[]))
               for t, s in workload]
    trace = []
    for step in range(400):
        for t, s in [p for p in pending if p[0] == step]:
            sched.add(s)
        for batch in fake_steps(sched):
            trace.append((step, batch.phase, ids(batch.seqs), ids(batch.preempted)))
            for s in batch.seqs:
                if s.num_output_tokens >= 6 and not s.is_finished:
                    sched.finish(s)
    return trace


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_client_schedules_exactly_as_without_fair_share(chunked: bool, policy: str) -> None:
    for seed in range(3):
        work = _workload(seed, "addr:127.0.0.1")
        kw = dict(num_blocks=24, block_size=4, max_num_seqs=6, max_batched=40,
                  chunked=chunked, policy=policy)
        fair = _trace(make_fair(fair=True, **kw), work)
        plain = _trace(make_fair(fair=False, **kw), work)
        assert fair == plain
        assert any(t[3] for t in plain)  # the workload does preempt


def test_many_clients_all_finish_under_pressure() -> None:
    sched = make_fair(num_blocks=24, block_size=4, max_num_seqs=6, max_batched=40)
    work = _workload(7, ["A", "B", "C"])
    _trace(sched, work)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 24
