"""Continuous batching: FCFS (or fair-share) admission, prefill and decode steps, preemption
by recompute.

Pure Python: it decides *which* sequences run; the model runner decides *how*.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from server.config import SchedulerLimits
from server.engine.core.block_manager import AllocationPlan, BlockManager
from server.engine.core.fair_share import ClientQueues, block_victim, fair_victim
from server.engine.core.sequence import ScheduledBatch, Sequence, SequenceStatus
from server.engine.core.state_cache import StateSlots
from server.engine.multimodal.inputs import chunk_end
from server.hpu.types import Phase

# a proposer: (sequences, most drafts each may have) -> their draft tokens; the slots of
# those drafts are already allocated (a draft model writes its own K/V there)
Propose = Callable[[list[Sequence], list[int]], list[list[int]]]


@dataclass(frozen=True, slots=True)
class Speculation:
    """What the scheduler needs of speculative decoding: the proposer, the most drafts per
    sequence, and the running batch size above which decodes go plain (None: never)."""

    propose: Propose
    num_speculative_tokens: int
    disable_by_batch_size: int | None = None


class Scheduler:
    """Keeps the waiting queue and the running set and plans one step at a time.

    Policy (like vLLM's V0 default, which the Gaudi backend keeps): new prompts join between
    steps as a prefill batch whenever they fit (sequence slots, token budget, free blocks);
    otherwise every running sequence decodes one token. When a decode needs a block and none
    is free, the newest running sequence (by arrival) is preempted: its blocks are freed and
    it goes back to the head of the queue, to be recomputed from its tokens later. The
    running set is kept in arrival order, so a request that was preempted and re-admitted is
    still older than those that came after it: the oldest request is never the victim, and
    requests finish roughly in the order they came.

    With the ``priority`` policy the same order is by (priority, arrival): the queue admits
    the most urgent first and preemption takes the least urgent, newest sequence.

    Fair share (``limits.fair_share``, sequences tagged with ``Sequence.client``): admission
    takes, within the most urgent priority level waiting, the head of the client with the
    fewest running sequences (ties by arrival), so clients are served round-robin, weighted
    by what each already holds; a request's sequences are admitted one after the other.
    When the batch is full (``max_num_seqs`` or KV blocks) and such a client waits, a
    sequence of the client holding the most gives way (recompute preemption), under this
    rule against thrashing: only a client holding at least two more running sequences than
    the waiting one gives way (after the swap it still holds at least as many, so no two
    clients trade a slot back and forth); only a sequence that has run 8 steps since its
    admission (``MIN_STEPS_BEFORE_FAIR_PREEMPTION``: a prefill is never wasted at once, and
    a sequence that came back is not sent back at the next step); never a more urgent one
    for a less urgent one. A decode short of a block preempts the least urgent sequence of
    the client holding the most. Every rule picks what the plain order picks when one
    client is present, so one client (or fair share off) schedules exactly as FCFS does.
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        prefill_fits: Callable[[int, int], bool] | None = None,
        fuse_decodes: bool = False,
        max_loras: int | None = None,
        speculation: Speculation | None = None,
        state_slots: StateSlots | None = None,
    ) -> None:
        self.limits = limits
        # hybrid models: a running sequence also holds a state slot (taken on admission,
        # given back with its blocks)
        self.state_slots = state_slots
        # --speculative-config: decodes carry draft tokens (a verify step)
        self.speculation = speculation
        # --enable-lora: distinct adapters among the running sequences, at most (the device
        # slots); a request whose adapter would be one too many waits, later ones may pass
        self.max_loras = max_loras
        self._pass_loras: set[int] = set()  # adapters admitted by the current pass
        # chunked prefill: decodes join the step's prompt chunks as one-token chunks of one
        # batch (the runner packs them into a single forward, eager CPU)
        self.fuse_decodes = fuse_decodes and limits.chunked_prefill
        self.block_manager = block_manager
        # Padding-aware admission: (num_seqs, max_tokens) -> whether the padded prefill
        # batch still has a bucket within the token budget. None: no padding constraint.
        self.prefill_fits = prefill_fits
        self._order = _priority_order if limits.policy == "priority" else _arrival_order
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0
        # fair share: the waiting queue per client (a mirror of ``waiting``), and the step of
        # each running sequence's admission (against thrashing)
        self.fair = limits.fair_share
        self._queues = ClientQueues(self._order, limits.policy == "priority")
        self._waiting_stale = False  # ``waiting`` still holds sequences admitted out of order
        self._step = 0
        self._admitted_at: dict[int, int] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queues a sequence in arrival order: requests are tokenized concurrently, so they
        can reach the scheduler in another order than they reached the server."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._order)
        if self.fair:
            self._queues.add(seq)

    def schedule(self) -> list[ScheduledBatch]:
        """The next step's batches (none when there is nothing to run).

        Separate phases (the reference's policy): a prefill of whole prompts whenever new
        ones fit, otherwise a decode of every running sequence. Chunked prefill: every
        running decode first, then prompt chunks in the token budget left (the decode and
        the prefill run back to back in the same step, or as one batch with
        ``fuse_decodes``), so a long prompt never stalls the decodes for more than one
        chunk. Fair share makes room for the clients it admits first (before the decode is
        planned: a sequence that gives way must not be in it).
        """
        self._step += 1
        rebalanced = self._rebalance() if self.fair else []
        if not self.limits.chunked_prefill:
            batch = self._schedule_prefill() or self._schedule_decode()
            if batch is None and rebalanced:
                batch = ScheduledBatch(Phase.DECODE, [], [])
            if batch is not None:
                batch.preempted[:0] = rebalanced
            return [batch] if batch is not None else []
        decode = self._schedule_decode()
        if rebalanced:
            decode = decode or ScheduledBatch(Phase.DECODE, [], [])
            decode.preempted[:0] = rebalanced
        chunks = self._schedule_chunks(self._prompt_budget(decode))
        if (self.fuse_decodes and decode is not None and decode.seqs and len(chunks) == 1
                and decode.spec_token_ids is None):
            prompt = chunks[0]
            assert prompt.num_new_tokens is not None
            return [ScheduledBatch(Phase.PREFILL, decode.seqs + prompt.seqs, decode.preempted,
                                   [1] * len(decode.seqs) + prompt.num_new_tokens)]
        return ([decode] if decode is not None else []) + chunks

    def advance(self, batch: ScheduledBatch, accepted: list[int] | None = None) -> None:
        """Records that ``batch`` ran: its tokens' K/V are in the cache now. A verify
        step: ``accepted`` drafts per row, whose K/V (and the last token's) are kept; the
        rejected ones' slots are free to be overwritten."""
        for row, seq in enumerate(batch.seqs):
            if accepted is not None:
                seq.num_computed_tokens += 1 + accepted[row]
            else:
                seq.num_computed_tokens += batch.new_tokens(row)

    def finish(self, seq: Sequence) -> None:
        """Retires a sequence that ran (stopped or aborted): its blocks go back to the pool."""
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.free(seq)
        self._admitted_at.pop(seq.seq_id, None)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Removes every sequence of a request wherever it is; returns them."""
        removed = [s for s in self.waiting if s.request_id == request_id]
        removed += [s for s in self.running if s.request_id == request_id]
        if removed:
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
            if self.fair:
                self._queues.remove(removed)
            for seq in removed:
                self.finish(seq)
        return removed

    def _schedule_prefill(self) -> ScheduledBatch | None:
        self._pass_loras.clear()
        seqs: list[Sequence] = []
        num_tokens = 0
        longest = 0
        counts = self._running_counts()
        while self.waiting and len(self.running) + len(seqs) < self.limits.max_num_seqs:
            seq = self._next_waiting(counts, seqs[-1] if seqs else None)
            if seq is None:
                break
            plan = self.block_manager.plan(seq)
            if not plan.fits or not self._state_slot_free():
                break
            if plan.num_cached_tokens and self.limits.context_prefill_alone:
                if seqs:  # static shapes: a prefill after a cached prefix runs alone
                    break
                self._admit(seq, plan, counts)
                seqs.append(seq)
                break
            # only the tokens past its cached prefix are computed
            new_tokens = seq.num_tokens - plan.num_cached_tokens
            if num_tokens + new_tokens > self.limits.max_num_batched_tokens:
                break
            longest_with = max(longest, new_tokens)
            if seqs and self.prefill_fits and not self.prefill_fits(len(seqs) + 1, longest_with):
                break
            self._admit(seq, plan, counts)
            seqs.append(seq)
            num_tokens += new_tokens
            longest = longest_with
        self._sync_waiting()
        if not seqs:
            return None
        for seq in seqs:
            bisect.insort(self.running, seq, key=self._order)
        return ScheduledBatch(Phase.PREFILL, seqs)

    def _schedule_chunks(self, budget: int) -> list[ScheduledBatch]:
        """Prompt chunks within ``budget`` tokens: the prompts already started first (in
        order), then new admissions. A chunk that stops short of the prompt's end ends on a
        block boundary, so every later chunk starts on one. One batch, or with static
        shapes one per prefill with context plus one of those without."""
        alone: list[ScheduledBatch] = []  # prefills with context, with static shapes
        seqs: list[Sequence] = []
        chunks: list[int] = []

        def add(seq: Sequence, chunk: int, has_context: bool) -> None:
            if has_context and self.limits.context_prefill_alone:
                alone.append(ScheduledBatch(Phase.PREFILL, [seq], num_new_tokens=[chunk]))
            else:
                seqs.append(seq)
                chunks.append(chunk)

        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill:
                continue
            chunk = self._chunk(seq, seq.num_computed_tokens, budget)
            if chunk == 0:
                break
            add(seq, chunk, seq.num_computed_tokens > 0)
            budget -= chunk
        admitted: list[Sequence] = []
        self._pass_loras.clear()
        counts = self._running_counts()
        while (self.waiting and budget > 0
               and len(self.running) + len(admitted) < self.limits.max_num_seqs):
            seq = self._next_waiting(counts, admitted[-1] if admitted else None)
            if seq is None:
                break
            plan = self.block_manager.plan(seq)
            if not plan.fits or not self._state_slot_free():
                break
            chunk = self._chunk(seq, plan.num_cached_tokens, budget)
            if chunk == 0:
                break
            grouped = not (plan.num_cached_tokens and self.limits.context_prefill_alone)
            if (grouped and seqs and self.prefill_fits
                    and not self.prefill_fits(len(seqs) + 1, max(chunks + [chunk]))):
                break
            self._admit(seq, plan, counts)
            admitted.append(seq)
            add(seq, chunk, plan.num_cached_tokens > 0)
            budget -= chunk
        self._sync_waiting()
        for seq in admitted:
            bisect.insort(self.running, seq, key=self._order)
        if seqs:
            alone.append(ScheduledBatch(Phase.PREFILL, seqs, num_new_tokens=chunks))
        return alone

    def _prompt_budget(self, decode: ScheduledBatch | None) -> int:
        """What a mixed step leaves for prompt chunks: the token budget less the decodes,
        or less the decodes that will run beside the last prompt of those running and
        waiting (all of them but that one, up to ``max_num_seqs``; at most half the
        budget), whichever is more. A lone prompt keeps the whole budget.

        Planning against the full batch keeps the admission rate of a burst what the steps
        can sustain once that batch decodes. Counting only today's decodes let a burst of
        64 prompts into a still-small batch two at a time; a closed-loop client
        sends its next request as each finishes, so those fast admissions came back as
        arrivals faster than the full batch admits them (448 tokens a step), queued, and
        the second wave waited ~2 s for its first token (measured: TTFT p50 at 64 streams
        2.2 -> 1.0 s on ~230-token chat prompts, 1.25 -> 0.83 s on 200-token ones)."""
        limit = self.limits.max_num_batched_tokens
        decodes = len(decode.seqs) if decode is not None else 0
        planned = min(self.limits.max_num_seqs, len(self.running) + len(self.waiting) - 1,
                      limit // 2)
        # Never under one block where the decodes leave one: a chunk that stops short of
        # its prompt ends on a block boundary, so less would stall every prompt of a step
        # with nothing decoding (a 16-token budget with 16-token blocks and two prompts).
        return max(limit - max(decodes, planned),
                   min(limit - decodes, self.block_manager.block_size))

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """The next chunk of ``seq``'s prompt from ``start``: all of it within ``budget``,
        else the most whole blocks, shortened so as not to cut an image's tokens in two."""
        remaining = seq.num_tokens - start
        block = self.block_manager.block_size
        chunk = remaining if remaining <= budget else budget // block * block
        if seq.images:
            chunk = chunk_end(seq.images, start, start + chunk, start + budget) - start
        return chunk

    def _schedule_decode(self) -> ScheduledBatch | None:
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.in_prefill:  # all its blocks were allocated on admission
                i += 1
                continue
            if self.block_manager.can_append(seq):
                self.block_manager.append_slot(seq)
                i += 1
                continue
            # The last in order: the newest arrival (of the least urgent priority); it has
            # waited least and usually has the least to redo. Fair share: of the client
            # holding the most (the same sequence when one client runs).
            at = block_victim(self.running, self._queues) if self.fair else len(self.running) - 1
            victim = self.running.pop(at)
            if at < i:  # it had its slot already: the ones after it moved down
                i -= 1
            self._preempt(victim)
            preempted.append(victim)
        decoding = [seq for seq in self.running if not seq.in_prefill]
        if not decoding:
            return ScheduledBatch(Phase.DECODE, [], preempted) if preempted else None
        return ScheduledBatch(Phase.DECODE, decoding, preempted, None, self._drafts(decoding))

    def _drafts(self, decoding: list[Sequence]) -> list[list[int]] | None:
        """Each decoding sequence's draft tokens, with the blocks they are written to;
        None (a plain decode) when speculation is off, the batch is above
        ``disable_by_batch_size`` or no sequence has a draft. The blocks of up to ``k``
        drafts are taken before proposing (a draft model writes its K/V there) and those of
        drafts not proposed given back. Drafts never claim a block another sequence would
        need: every decoding sequence holds its next token's block already, and one short
        of blocks for its drafts drafts nothing."""
        spec = self.speculation
        if spec is None or (spec.disable_by_batch_size is not None
                            and len(self.running) > spec.disable_by_batch_size):
            return None
        limits: list[int] = []
        for seq in decoding:
            params = seq.params
            # no draft past the length limits (their tokens would be cut), nor where a
            # grammar constrains each position (its mask follows the accepted tokens)
            limit = min(spec.num_speculative_tokens,
                        self.limits.max_model_len - seq.num_tokens)
            if params.max_tokens is not None:
                limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
            if limit > 0 and seq.grammar is None and self.block_manager.can_append(seq, limit):
                self.block_manager.append_slot(seq, limit)
            else:
                limit = 0
            limits.append(limit)
        if not any(limits):
            return None
        drafts = spec.propose(decoding, limits)
        for seq, found, limit in zip(decoding, drafts, limits):
            if len(found) < limit:  # the blocks of drafts not proposed go back
                self.block_manager.trim(seq, len(found))
        return drafts if any(drafts) else None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.state_slots is not None:  # recomputed from its tokens when it comes back
            self.state_slots.free(seq)
        self._admitted_at.pop(seq.seq_id, None)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)  # ahead of later arrivals

    def _state_slot_free(self) -> bool:
        return self.state_slots is None or self.state_slots.num_free > 0

    def _running_counts(self) -> Counter[str]:
        """Running sequences per client (fair share only; empty otherwise)."""
        return Counter(s.client for s in self.running) if self.fair else Counter()

    def _next_waiting(self, counts: Counter[str], last: Sequence | None) -> Sequence | None:
        """The sequence to admit next: the queue's head, or with fair share the head of the
        least served client (``counts``: running, with this pass's admissions)."""
        if self.max_loras is None:
            return self.waiting[0] if not self.fair else self._queues.pick(counts, after=last)
        active = self.running_loras() | self._pass_loras
        if not self.fair:
            for seq in self.waiting:
                if seq.status is SequenceStatus.WAITING and self._lora_fits(seq, active):
                    return seq
            return None
        seq = self._queues.pick(counts, after=last)
        return seq if seq is None or self._lora_fits(seq, active) else None

    def running_loras(self) -> set[int]:
        """Ids of the adapters the running sequences use."""
        return {s.lora.lora_int_id for s in self.running if s.lora is not None}

    def _lora_fits(self, seq: Sequence, active: set[int]) -> bool:
        assert self.max_loras is not None
        return (seq.lora is None or seq.lora.lora_int_id in active
                or len(active) < self.max_loras)

    def _admit(self, seq: Sequence, plan: AllocationPlan, counts: Counter[str]) -> None:
        """Moves ``seq`` (from ``_next_waiting``) out of the queue and gives it its blocks."""
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:  # fair share took it out of arrival order: dropped from ``waiting`` at the end
            self._waiting_stale = True
        if self.fair:
            self._queues.pop(seq)
            counts[seq.client] += 1
        self.block_manager.allocate(seq, plan)
        if self.state_slots is not None:
            self.state_slots.allocate(seq)
        if seq.lora is not None:
            self._pass_loras.add(seq.lora.lora_int_id)
        seq.status = SequenceStatus.RUNNING
        self._admitted_at[seq.seq_id] = self._step

    def _sync_waiting(self) -> None:
        if self._waiting_stale:
            self.waiting = deque(s for s in self.waiting if s.status is SequenceStatus.WAITING)
            self._waiting_stale = False

    def _rebalance(self) -> list[Sequence]:
        """Fair share: preempts, under the class's rules, what the clients waiting with fewer
        running sequences need: a batch slot each (walking the queues in admission order,
        the free slots counted as theirs first), and for the first of them its KV blocks.
        The admission pass that follows then takes them."""
        if not self.waiting:
            return []
        counts = self._running_counts()
        if len(self._queues) == 1 and all(c in self._queues.queues for c in counts):
            return []  # one client: nobody to balance against
        free = self.limits.max_num_seqs - len(self.running)
        planned: Counter[str] = Counter()  # sequences per client counted as admitted
        num_planned = 0
        preempted: list[Sequence] = []
        last: Sequence | None = None
        for _ in range(self.limits.max_num_seqs):
            seq = self._queues.pick(counts + planned, planned, last)
            if seq is None:
                break
            if free > 0 and (planned or self.block_manager.plan(seq).fits):
                if free >= len(self.waiting) - num_planned:
                    break  # every sequence still waiting has a slot: nobody gives way
                free -= 1
                num_planned += 1
                planned[seq.client] += 1
                last = seq
                continue
            at = fair_victim(self.running, self._queues, counts + planned, seq,
                             self._admitted_at, self._step)
            if at is None:
                break
            victim = self.running.pop(at)
            counts[victim.client] -= 1
            self._preempt(victim)
            self.num_fair_preemptions += 1
            preempted.append(victim)
            free = max(free, 1)
        return preempted


def _arrival_order(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


def _priority_order(seq: Sequence) -> tuple[int, float, int]:
    return seq.params.priority, seq.arrival_time, seq.seq_id
