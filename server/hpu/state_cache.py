"""The state cache of hybrid models (Qwen3-Next's linear-attention layers): fixed-size slots
beside the paged KV cache, one per running sequence.

Where a KV cache grows a block at a time, a linear-attention layer keeps the same few
tensors per sequence however long it gets (its convolution's last inputs and its recurrent
state). Every linear layer holds them for ``num_slots + 1`` slots; slot ``num_slots`` is the
padding slot, as block ``num_blocks`` is the padding block: pad rows read and write there,
so a batch's slot indices are a plain ``[bs]`` tensor of its bucket's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One linear layer's tensors, each ``[num_slots + 1, ...]``: its causal convolution's last
# inputs ``[C, K - 1]`` and its recurrent state ``[Hv, Dk, Dv]``.
LayerState = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class StateShape:
    """Per-slot shapes and dtypes of one linear layer's state tensors."""

    conv: tuple[int, ...]
    conv_dtype: torch.dtype
    recurrent: tuple[int, ...]
    recurrent_dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        def size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
            n = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                n *= d
            return n

        return size(self.conv, self.conv_dtype) + size(self.recurrent, self.recurrent_dtype)


@dataclass(slots=True)
class StateInputs:
    """Each batch row's state slot and how its state advances this step (device tensors
    of the bucket's batch size; pad rows: the padding slot, no tokens, no state)."""

    slots: torch.Tensor  # [bs] long
    query_lens: torch.Tensor  # [bs] long: the row's real tokens this step
    # [bs] bool: the row continues a state (false: its sequence starts here, from zeros)
    has_state: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.slots, self.query_lens, self.has_state

    def clone(self) -> StateInputs:
        """A copy in fresh storage (a captured graph's static inputs)."""
        return StateInputs(*(t.clone() for t in self.tensors()))

    def copy_(self, src: StateInputs) -> None:
        """Copies ``src``'s values into these tensors (before a graph's replay)."""
        for dst, value in zip(self.tensors(), src.tensors()):
            dst.copy_(value)


def allocate_state_cache(shapes: list[StateShape], num_slots: int, device: torch.device
                         ) -> list[LayerState]:
    """Zero-filled state tensors for ``num_slots`` slots plus the padding slot, per layer."""
    return [(torch.zeros((num_slots + 1, *s.conv), dtype=s.conv_dtype, device=device),
             torch.zeros((num_slots + 1, *s.recurrent), dtype=s.recurrent_dtype, device=device))
            for s in shapes]


def state_cache_bytes(shapes: list[StateShape], num_slots: int) -> int:
    """What :func:`allocate_state_cache` takes, the padding slot included."""
    return (num_slots + 1) * sum(s.bytes_per_slot for s in shapes)
