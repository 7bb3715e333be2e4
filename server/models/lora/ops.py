"""The batched LoRA op: each token row adds its own adapter's ``x A^T B^T``, for any mix of
adapters in one static-shape batch. ``benchmarks/lora_ops.py`` measures the ways to compute
it; the model runs :func:`lora_dense` (static shapes: every execution mode), or on the eager CPU
backend :func:`lora_kernel`, the same delta in one fused call per projection.

Shapes: ``x [T, in]``; the slot stacks ``a [P, S, r, in]`` (part ``p``'s shrink rows for
each of the ``S`` slots) and ``bt [S, r, out]`` (part ``p`` writes only its own output
columns, ``sum(parts[:p]) ..``, from its own ``r`` shrink rows); ``slots [T]`` each row's
slot, 1..S (0: no adapter); ``parts`` the output widths of the site's parts (q/k/v: 3,
gate/up: 2, o and down: 1). Keeping ``B^T`` per part rather than as one block-diagonal
``[P * r, out]`` makes the expand ``P`` times cheaper, and parts outermost in ``a`` makes
each part's shrink output a plain strided view (no copies between the GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_mask(slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, S]`` one-hot of each row's slot over slots 1..S (a row without adapter: all
    zeros); built once per step and shared by every layer."""
    return F.one_hot(slots.reshape(-1), num_slots + 1)[:, 1:].to(dtype)


def _expand(h: torch.Tensor, bt: torch.Tensor, parts: tuple[int, ...],
            base: torch.Tensor | None) -> torch.Tensor:
    """``h [T, P, n * r]`` against ``bt [n, r, out]``: each part's shrink rows times its
    own columns of ``B^T`` (strided views of the weights: nothing copied), added to
    ``base`` in the same GEMM where given."""
    n, rank, outputs = bt.shape
    outs, start = [], 0
    for p, width in enumerate(parts):
        weight = bt[:, :, start:start + width].reshape(n * rank, width)
        outs.append(h[:, p] @ weight if base is None
                    else torch.addmm(base[:, start:start + width], h[:, p], weight))
        start += width
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def lora_dense(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, mask: torch.Tensor,
               parts: tuple[int, ...], base: torch.Tensor | None = None) -> torch.Tensor:
    """``base`` (``[T, out]``, or zeros) plus each row's delta: every slot's shrink for
    every row as one GEMM, the row's own slot kept by the mask, one expand GEMM per part:
    fixed-shape matmuls whatever the mix."""
    num_parts, num_slots, rank = a.shape[:3]
    h = F.linear(x, a.reshape(-1, a.shape[3]))
    h = (h.view(-1, num_parts, num_slots, rank) * mask.view(-1, 1, num_slots, 1))
    return _expand(h.view(-1, num_parts, num_slots * rank), bt, parts, base)


def kernel_rows(slots: torch.Tensor) -> torch.Tensor:
    """Each row's slot index as :func:`lora_kernel` reads it, 0..S-1 (-1: no adapter);
    built once per step and shared by every layer."""
    return (slots.reshape(-1) - 1).contiguous()


def lora_kernel(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor,
                parts: tuple[int, ...], base: torch.Tensor) -> torch.Tensor:
    """:func:`lora_dense`'s result, ``base`` (``[T, out]``, contiguous, a's dtype) updated
    in place by ``torch.ops.hpu_serve.lora_add_`` (server/hpu/cpu/csrc/lora_kernels.cpp):
    rows grouped by slot inside the kernel, each present slot's weights read once, slots
    no row uses and rows of slot -1 skipped; ``rows`` from :func:`kernel_rows`."""
    torch.ops.hpu_serve.lora_add_(base, x.contiguous(), a, bt, rows, list(parts))
    return base


def lora_gather(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor,
                parts: tuple[int, ...]) -> torch.Tensor:
    """Each row's own A and B gathered, batched matmuls (``T`` copies of the weights:
    cheap for decode, heavy for prefill; static shapes)."""
    index = (slots - 1).clamp(min=0)
    own_a = a.index_select(1, index).transpose(0, 1).flatten(1, 2)  # [T, P * r, in]
    h = torch.bmm(own_a, x.unsqueeze(-1)).view(x.shape[0], len(parts), -1)
    h = h * (slots > 0).to(h.dtype).view(-1, 1, 1)
    own_bt = bt.index_select(0, index)  # [T, r, out]
    outs, start = [], 0
    for p, width in enumerate(parts):
        outs.append(torch.bmm(h[:, p:p + 1], own_bt[:, :, start:start + width]).squeeze(1))
        start += width
    return torch.cat(outs, dim=1)


def lora_grouped(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                 groups: list[tuple[int, torch.Tensor]], parts: tuple[int, ...]
                 ) -> torch.Tensor:
    """Rows grouped by slot, one shrink and one expand per part for each adapter present:
    ``groups`` (slot, its rows) from :func:`slot_groups`. Data-dependent shapes: eager
    only."""
    out = x.new_zeros(x.shape[0], bt.shape[2])
    for slot, rows in groups:
        own_a = a[:, slot - 1].reshape(-1, a.shape[3])  # [P * r, in]
        h = F.linear(x.index_select(0, rows), own_a).view(-1, len(parts), a.shape[2])
        out.index_add_(0, rows, _expand(h, bt[slot - 1:slot], parts, None))
    return out


def slot_groups(slots: list[int]) -> list[tuple[int, torch.Tensor]]:
    """(slot, its row indices) for each adapter slot in ``slots`` (host side; 0 left
    out)."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot:
            rows.setdefault(slot, []).append(row)
    return [(slot, torch.tensor(r)) for slot, r in sorted(rows.items())]
