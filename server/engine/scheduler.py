"""Continuous batching: FCFS admission, prefill and decode steps, preemption by recompute.

Pure Python: it decides *which* sequences run; the model runner decides *how*.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from server.config import MIN_BATCHED_TOKENS, SchedulerConfig
from server.engine.block_manager import BlockManager
from server.engine.sequence import ScheduledBatch, Sequence, SequenceStatus
from server.hpu.types import Phase


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """Resolved batch limits (no ``None``: the model is known by now)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    # prompts split over steps under the token budget, decodes first (mixed steps)
    chunked_prefill: bool = False
    # static shapes: a prefill after a context (cached prefix, earlier chunks) runs as its
    # own batch, as the prompt buckets with context blocks have batch size 1
    context_prefill_alone: bool = False

    @classmethod
    def resolve(cls, config: SchedulerConfig, model_max_len: int,
                chunked_prefill: bool | None = None,
                context_prefill_alone: bool = False,
                chunked_budget: int = MIN_BATCHED_TOKENS) -> SchedulerLimits:
        """The flags' limits with the model's defaults filled in, checked against it.
        ``chunked_prefill`` overrides the flag; ``chunked_budget``: the platform's step
        budget with chunked prefill when ``--max-num-batched-tokens`` is unset."""
        chunked = config.enable_chunked_prefill if chunked_prefill is None else chunked_prefill
        max_model_len = config.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"{model_max_len}")
        max_batched = config.batched_tokens_for(max_model_len, chunked, chunked_budget)
        if max_batched < max_model_len and not chunked:
            # Without chunked prefill a whole prompt must fit one step's token budget.
            raise ValueError(
                f"--max-num-batched-tokens ({max_batched}) must be >= --max-model-len "
                f"({max_model_len}) since prompts are not chunked (--no-enable-chunked-prefill)")
        return cls(config.max_num_seqs, max_batched, max_model_len, config.policy, chunked,
                   context_prefill_alone)


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
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        prefill_fits: Callable[[int, int], bool] | None = None,
        fuse_decodes: bool = False,
    ) -> None:
        self.limits = limits
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

    def schedule(self) -> list[ScheduledBatch]:
        """The next step's batches (none when there is nothing to run).

        Separate phases (the reference's policy): a prefill of whole prompts whenever new
        ones fit, otherwise a decode of every running sequence. Chunked prefill: every
        running decode first, then prompt chunks in the token budget left (the decode and
        the prefill run back to back in the same step, or as one batch with
        ``fuse_decodes``), so a long prompt never stalls the decodes for more than one
        chunk.
        """
        if not self.limits.chunked_prefill:
            batch = self._schedule_prefill() or self._schedule_decode()
            return [batch] if batch is not None else []
        decode = self._schedule_decode()
        budget = self.limits.max_num_batched_tokens - (len(decode.seqs) if decode else 0)
        chunks = self._schedule_chunks(budget)
        if self.fuse_decodes and decode is not None and decode.seqs and len(chunks) == 1:
            prompt = chunks[0]
            assert prompt.num_new_tokens is not None
            return [ScheduledBatch(Phase.PROMPT, decode.seqs + prompt.seqs, decode.preempted,
                                   [1] * len(decode.seqs) + prompt.num_new_tokens)]
        return ([decode] if decode is not None else []) + chunks

    def advance(self, batch: ScheduledBatch) -> None:
        """Records that ``batch`` ran: its tokens' K/V are in the cache now."""
        for row, seq in enumerate(batch.seqs):
            seq.num_computed_tokens += batch.new_tokens(row)

    def finish(self, seq: Sequence) -> None:
        """Retires a sequence that ran (stopped or aborted): its blocks go back to the pool."""
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Removes every sequence of a request wherever it is; returns them."""
        removed = [s for s in self.waiting if s.request_id == request_id]
        removed += [s for s in self.running if s.request_id == request_id]
        if removed:
            self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
            for seq in removed:
                self.finish(seq)
        return removed

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        num_tokens = 0
        longest = 0
        while self.waiting and len(self.running) + len(seqs) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            plan = self.block_manager.plan(seq)
            if not plan.fits:
                break
            if plan.num_cached_tokens and self.limits.context_prefill_alone:
                if seqs:  # static shapes: a prefill after a cached prefix runs alone
                    break
                self.waiting.popleft()
                self.block_manager.allocate(seq, plan)
                seq.status = SequenceStatus.RUNNING
                seqs.append(seq)
                break
            # only the tokens past its cached prefix are computed
            new_tokens = seq.num_tokens - plan.num_cached_tokens
            if num_tokens + new_tokens > self.limits.max_num_batched_tokens:
                break
            longest_with = max(longest, new_tokens)
            if seqs and self.prefill_fits and not self.prefill_fits(len(seqs) + 1, longest_with):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, plan)
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
            num_tokens += new_tokens
            longest = longest_with
        if not seqs:
            return None
        for seq in seqs:
            bisect.insort(self.running, seq, key=self._order)
        return ScheduledBatch(Phase.PROMPT, seqs)

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
                alone.append(ScheduledBatch(Phase.PROMPT, [seq], num_new_tokens=[chunk]))
            else:
                seqs.append(seq)
                chunks.append(chunk)

        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill:
                continue
            chunk = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if chunk == 0:
                break
            add(seq, chunk, seq.num_computed_tokens > 0)
            budget -= chunk
        admitted: list[Sequence] = []
        while (self.waiting and budget > 0
               and len(self.running) + len(admitted) < self.limits.max_num_seqs):
            seq = self.waiting[0]
            plan = self.block_manager.plan(seq)
            if not plan.fits:
                break
            chunk = self._chunk(seq.num_tokens - plan.num_cached_tokens, budget)
            if chunk == 0:
                break
            grouped = not (plan.num_cached_tokens and self.limits.context_prefill_alone)
            if (grouped and seqs and self.prefill_fits
                    and not self.prefill_fits(len(seqs) + 1, max(chunks + [chunk]))):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, plan)
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            add(seq, chunk, plan.num_cached_tokens > 0)
            budget -= chunk
        for seq in admitted:
            bisect.insort(self.running, seq, key=self._order)
        if seqs:
            alone.append(ScheduledBatch(Phase.PROMPT, seqs, num_new_tokens=chunks))
        return alone

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        block = self.block_manager.block_size
        return budget // block * block

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
            # waited least and usually has the least to redo.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
        decoding = [seq for seq in self.running if not seq.in_prefill]
        if not decoding:
            return ScheduledBatch(Phase.DECODE, [], preempted) if preempted else None
        return ScheduledBatch(Phase.DECODE, decoding, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._order)  # ahead of later arrivals


def _arrival_order(seq: Sequence) -> tuple[float, int]:
    return seq.arrival_time, seq.seq_id


def _priority_order(seq: Sequence) -> tuple[int, float, int]:
    return seq.params.priority, seq.arrival_time, seq.seq_id
