"""The batched LoRA op: each token row adds its own adapter's ``x A^T B^T``, for any mix of
adapters in one static-shape batch. Three ways to compute it; ``benchmarks/lora_ops.py``
measures them and the model uses :func:`lora_dense` (see that script's numbers in
docs/lora.md).

Shapes: ``x [T, in]``; the slot stacks ``a [S + 1, P * r, in]`` and ``bt [S + 1, P * r,
out]`` with slot 0 all zeros (no adapter); ``slots [T]`` each row's slot (0: none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]`` one-hot of each row's slot over slots 1..S (a row without adapter: all
    zeros); built once per step and shared by every layer."""
    return F.one_hot(slots.reshape(-1), num_slots + 1)[:, 1:].to(dtype)


def lora_dense(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Every slot's shrink for every row as one GEMM, the row's own slot kept by the mask,
    then one expand GEMM: two fixed-shape matmuls whatever the mix (slot 0 skipped)."""
    num_slots, width, inputs = a.shape[0] - 1, a.shape[1], a.shape[2]
    h = F.linear(x, a[1:].reshape(num_slots * width, inputs))
    h = (h.view(-1, num_slots, width) * mask.unsqueeze(-1)).view(-1, num_slots * width)
    return h @ bt[1:].reshape(num_slots * width, bt.shape[2])


def lora_gather(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
    """Each row's own A and B gathered, two batched matmuls (``T`` copies of the weights:
    cheap for decode, heavy for prefill)."""
    h = torch.bmm(a.index_select(0, slots), x.unsqueeze(-1))  # [T, w, 1]
    return torch.bmm(h.transpose(1, 2), bt.index_select(0, slots)).squeeze(1)


def lora_grouped(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """Rows grouped by slot, one matmul pair per adapter present (data-dependent shapes:
    eager only)."""
    out = torch.zeros(x.shape[0], bt.shape[2], dtype=x.dtype, device=x.device)
    for slot in slots.unique().tolist():
        if slot == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        out.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].t()) @ bt[slot])
    return out
