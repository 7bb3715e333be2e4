"""State slots of hybrid models (Qwen3-Next): which running sequence owns which slot of the
state cache (server/hpu/state_cache.py holds the tensors).

A slot is a fixed-size piece of every linear-attention layer's state, so a sequence needs
exactly one however long it grows: it takes one when admitted and gives it back when it
finishes, is aborted or is preempted. A preempted sequence is recomputed from its tokens
when it comes back (the scheduler's policy), so its state is rebuilt from scratch in
whichever slot it gets then; nothing is ever swapped out.

Prefix caching does not apply to these models: a cached block holds keys and values, but
the linear layers' state after a prefix is not kept anywhere, so a hit could not skip the
prefix's computation. The engine turns it off for them (and logs so).
"""

from __future__ import annotations

from collections import deque

from server.engine.core.sequence import Sequence


class StateSlots:
    """Hands out slots ``0 .. num_slots - 1``; slot ``num_slots`` is the padding slot (pad
    rows read and write it), never handed out."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("the state cache needs at least one slot")
        self.num_slots = num_slots
        self.pad_slot = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Gives ``seq`` a slot (its state starts from zeros: its first step says so)."""
        assert seq.state_slot is None, f"sequence {seq.seq_id} already holds a state slot"
        if not self._free:
            raise RuntimeError("allocate() with no free state slot")
        seq.state_slot = self._free.popleft()

    def free(self, seq: Sequence) -> None:
        """Takes ``seq``'s slot back (a no-op for a sequence that holds none)."""
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None
