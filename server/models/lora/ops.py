"""The batched LoRA op: each token row adds its own adapter's ``x A^T B^T``, for any mix of
adapters in one static-shape batch. ``benchmarks/lora_ops.py`` measures the ways to compute
it; the model runs :func:`lora_dense` (static shapes: every execution mode) and, in eager
mode only, :func:`lora_grouped` when few adapters are in a step (see docs/lora.md).

Shapes: ``x [T, in]``; the slot stacks ``a [S + 1, P * r, in]`` (part ``p``'s rows
``p * r .. p * r + r``) and ``bt [S + 1, r, out]`` (part ``p`` writes its own output columns
``parts[:p] .. parts[:p + 1]`` from its own ``r`` shrink rows), slot 0 all zeros (no
adapter); ``slots [T]`` each row's slot (0: none); ``parts`` the output widths of the
site's parts (q/k/v: 3, gate/up: 2, o and down: 1). Keeping ``B^T`` per part rather than as
one block-diagonal ``[P * r, out]`` makes the expand ``P`` times cheaper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]`` one-hot of each row's slot over slots 1..S (a row without adapter: all
    zeros); built once per step and shared by every layer."""
    return F.one_hot(slots.reshape(-1), num_slots + 1)[:, 1:].to(dtype)


def _expand(h: torch.Tensor, bt: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """``h [T, n, P, r]`` (n slots, or one) against ``bt [n, r, out]``: each part's shrink
    rows times its own columns of ``B^T`` (strided views of the weights: nothing copied
    but the small ``h``)."""
    rows, n, _, rank = h.shape
    if len(parts) == 1:
        return h.reshape(rows, n * rank) @ bt.reshape(n * rank, bt.shape[2])
    outs, start = [], 0
    for p, width in enumerate(parts):
        weight = bt[:, :, start:start + width].reshape(n * rank, width)
        outs.append(h[:, :, p].reshape(rows, n * rank) @ weight)
        start += width
    return torch.cat(outs, dim=1)


def lora_dense(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, mask: torch.Tensor,
               parts: tuple[int, ...]) -> torch.Tensor:
    """Every slot's shrink for every row as one GEMM, the row's own slot kept by the mask,
    then one expand GEMM per part: fixed-shape matmuls whatever the mix (slot 0
    skipped)."""
    num_slots, rank = a.shape[0] - 1, bt.shape[1]
    h = F.linear(x, a[1:].reshape(-1, a.shape[2]))
    h = h.view(-1, num_slots, len(parts), rank) * mask.view(-1, num_slots, 1, 1)
    return _expand(h, bt[1:], parts)


def lora_gather(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
                parts: tuple[int, ...]) -> torch.Tensor:
    """Each row's own A and B gathered, batched matmuls (``T`` copies of the weights:
    cheap for decode, heavy for prefill; static shapes)."""
    h = torch.bmm(a.index_select(0, slots), x.unsqueeze(-1))  # [T, P * r, 1]
    h = h.view(x.shape[0], len(parts), -1)
    own = bt.index_select(0, slots)  # [T, r, out]
    outs, start = [], 0
    for p, width in enumerate(parts):
        outs.append(torch.bmm(h[:, p:p + 1], own[:, :, start:start + width]).squeeze(1))
        start += width
    return torch.cat(outs, dim=1)


def lora_grouped(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 groups: list[tuple[int, torch.Tensor]], parts: tuple[int, ...]
                 ) -> torch.Tensor:
    """Rows grouped by slot, one shrink and one expand per part for each adapter present:
    ``groups`` (slot, its rows) from :func:`slot_groups`. Data-dependent shapes: eager
    only."""
    out = x.new_zeros(x.shape[0], bt.shape[2])
    rank = bt.shape[1]
    for slot, rows in groups:
        h = F.linear(x.index_select(0, rows), a[slot]).view(-1, 1, len(parts), rank)
        out.index_add_(0, rows, _expand(h, bt[slot:slot + 1], parts))
    return out


def slot_groups(slots: list[int]) -> list[tuple[int, torch.Tensor]]:
    """(slot, its row indices) for each adapter slot in ``slots`` (host side; 0 left
    out)."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot:
            rows.setdefault(slot, []).append(row)
    return [(slot, torch.tensor(r)) for slot, r in sorted(rows.items())]
