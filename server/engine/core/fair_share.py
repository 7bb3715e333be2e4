"""Fair share between clients (``--fair-share``): each client's waiting sequences in their
own queue, who is admitted next, and whose sequence gives way when the batch is full.

Pure Python, used by the scheduler only when ``SchedulerConfig.fair_share`` is on. Every
choice here reduces to the scheduler's plain order when a single client is present.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from server.engine.core.sequence import Sequence

# Steps a sequence runs after its (re-)admission before a fair preemption may take it: a
# prefill is never thrown away at once, and a sequence that came back is not sent back at
# the next step (block shortage in a decode still preempts anything, as it must).
MIN_STEPS_BEFORE_FAIR_PREEMPTION = 8

Order = Callable[[Sequence], Any]


class ClientQueues:
    """The waiting sequences of each client, each queue in the scheduler's order (a mirror of
    the scheduler's global queue, which keeps the global order for counting and abort)."""

    def __init__(self, order: Order, by_priority: bool) -> None:
        self._order = order
        self._by_priority = by_priority
        self.queues: dict[str, deque[Sequence]] = {}

    def __len__(self) -> int:
        """Clients with something waiting."""
        return len(self.queues)

    def level(self, seq: Sequence) -> int:
        """Its priority level under the ``priority`` policy (lower: more urgent); one level
        for every sequence under ``fcfs``."""
        return seq.params.priority if self._by_priority else 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.queues.setdefault(seq.client, deque()), seq, key=self._order)

    def remove(self, seqs: Iterable[Sequence]) -> None:
        """Drops ``seqs`` (an aborted request's) wherever they wait."""
        gone = {id(s) for s in seqs}
        for client in {s.client for s in seqs}:
            queue = self.queues.get(client)
            if queue is None:
                continue
            kept = deque(s for s in queue if id(s) not in gone)
            if kept:
                self.queues[client] = kept
            else:
                del self.queues[client]

    def pop(self, seq: Sequence) -> None:
        """Takes ``seq``, the head of its client's queue, out (it is being admitted)."""
        queue = self.queues[seq.client]
        assert queue[0] is seq, "admission takes a client's queue in order"
        queue.popleft()
        if not queue:
            del self.queues[seq.client]

    def pick(self, running: Mapping[str, int], skip: Mapping[str, int] | None = None,
             after: Sequence | None = None) -> Sequence | None:
        """Whom to admit next: the most urgent level first, within it the client with the
        fewest running sequences (``running``), ties by the scheduler's order. A request's
        sequences go together: the one after ``after`` (the last admitted) comes next while
        its request has more waiting. ``skip``: sequences per client already counted as
        admitted (the head ones of its queue)."""
        skip = skip or {}
        if after is not None:
            queue = self.queues.get(after.client)
            i = skip.get(after.client, 0)
            if queue is not None and i < len(queue) and queue[i].request_id == after.request_id:
                return queue[i]
        best: Sequence | None = None
        best_key: tuple[Any, ...] = ()
        for client, queue in self.queues.items():
            i = skip.get(client, 0)
            if i >= len(queue):
                continue
            head = queue[i]
            key = (self.level(head), running.get(client, 0), self._order(head))
            if best is None or key < best_key:
                best, best_key = head, key
        return best


def fair_victim(running: list[Sequence], queues: ClientQueues, counts: Mapping[str, int],
                for_seq: Sequence, admitted_at: Mapping[int, int], step: int) -> int | None:
    """The index in ``running`` of the sequence to preempt so that ``for_seq`` can run, or
    None when none may give way. Eligible: another client's sequence, no more urgent than
    ``for_seq``, that has run MIN_STEPS_BEFORE_FAIR_PREEMPTION steps since its admission, of
    a client holding at least two more running sequences than ``for_seq``'s (after the swap
    it still holds at least as many: two clients never trade a slot back and forth). Among
    them: the least urgent level, then the client holding the most, then the last in order
    (the newest arrival, as the plain recompute preemption chooses)."""
    need = counts.get(for_seq.client, 0) + 2
    floor = queues.level(for_seq)
    best: int | None = None
    best_key: tuple[int, int, int] = (0, 0, 0)
    for i, seq in enumerate(running):
        held = counts.get(seq.client, 0)
        if (seq.client == for_seq.client or held < need or queues.level(seq) < floor
                or step - admitted_at.get(seq.seq_id, -MIN_STEPS_BEFORE_FAIR_PREEMPTION)
                < MIN_STEPS_BEFORE_FAIR_PREEMPTION):
            continue
        key = (queues.level(seq), held, i)
        if best is None or key > best_key:
            best, best_key = i, key
    return best


def block_victim(running: list[Sequence], queues: ClientQueues) -> int:
    """The index in ``running`` of the sequence to preempt when a decode needs a block and
    none is free: the least urgent level, then the client holding the most running
    sequences, then the last in order. With one client: the last in order, as without
    fair share."""
    counts: dict[str, int] = {}
    for seq in running:
        counts[seq.client] = counts.get(seq.client, 0) + 1
    return max(range(len(running)),
               key=lambda i: (queues.level(running[i]), counts[running[i].client], i))
