"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), static shapes throughout.

A linear router scores the ``E`` experts per token; the softmax over them (float32) picks the
top ``k``, whose weights are renormalised to sum to 1 where the family does so (Mixtral
always, Qwen3-MoE when ``norm_topk_prob``). Each expert is a SiLU-gated MLP; all experts'
weights live stacked in two tensors:

- ``w_gate_up [E, 2I, H]``: gate rows then up rows, each expert as ``MLP.gate_up_proj``;
- ``w_down [E, I, H]``: each expert's down projection *transposed* (Hugging Face stores
  ``[H, I]``), so that ``w_down.view(E * I, H)`` is a plain matrix (see the dense path).

The engine pads batches to fixed shapes and may compile or capture graphs per shape, so
nothing here depends on the routing for a shape: no ``nonzero``, no boolean masks, no loop
whose trip count comes from the data. Two computations, both exact (same sums as running
each token's experts one by one, up to float rounding order):

``dense``: every expert over every token, each expert's activations scaled by the token's
routing weight for it (0 for experts it did not pick) before the down projection. That is
two ordinary GEMMs, ``[T, H] x [H, E * 2I]`` and ``[T, E * I] x [E * I, H]``, reading each
weight once: the fewest, largest kernels, and the cheapest choice while ``E / k`` is small
or the batch has enough rows that a weight read is compute-bound anyway (prefill), but it
spends ``E / k`` times the useful FLOPs (Mixtral 8 / 2: 4x; Qwen3-30B-A3B 128 / 8: 16x).

Llama 4 weights each expert's *input* instead (``expert(w * x)``, not ``w * expert(x)``):
``scale_inputs``. Its experts have no biases, so that is ``w`` times the gate and up
projections, applied before the activation where the other families scale after it.

``grouped``: the ``T * k`` (token, expert) assignments sorted by expert into blocks of
``M`` rows, each expert's rows padded to whole blocks (at most ``T * k + min(E, T * k) *
(M - 1)`` rows, a static bound), one expert per block; each block's expert weights are
gathered (``index_select``) and all blocks run as one batched matmul (``bmm``). Compute is
proportional to the assignments, not to ``E``, but each block copies its expert's weights
once. ``M = 1`` is the plain gather for decode: one weight slice per (token, slot), no
sorting. A true grouped-GEMM kernel (vLLM's fused_moe, ``torch._grouped_mm``: private and
bf16-only in this torch) would skip the copies; this is the portable static-shape stand-in.

:func:`expert_plan` chooses between them from the shape alone (so per bucket, fixed for a
compiled graph), with a rough cost model: a pass over one expert costs ``max(rows, R)``
(a skinny GEMM is bound by reading its weight, ``R`` rows' worth of time) and a gathered
copy two more weight reads.

gpt-oss adds biases (the router's; each expert's gate/up ``b_gate_up [E, 2I]`` and down
``b_down [E, H]``, added before the routing weight scales the expert's output, exactly as
the weights are) and its clamped SwiGLU activation (:func:`clamped_swiglu`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from server.hpu.layer_ops import TorchLayerOps
from server.models.config import ModelConfig
from server.models.moe_routing import route

# Rows below which a GEMM takes about as long as reading its weight (the roofline knee,
# very roughly, across the devices served); only the choice of computation depends on it.
_WEIGHT_READ_ROWS = 64
_BLOCK_SIZES = (1, 4, 16, 64, 256)

DENSE = 0  # expert_plan's answer for the dense computation; otherwise the block size M


def grouped_blocks(tokens: int, top_k: int, num_experts: int, block: int) -> int:
    """How many ``block``-row blocks always hold the assignments sorted by expert."""
    assignments = tokens * top_k
    if block == 1:
        return assignments
    rows = assignments + min(num_experts, assignments) * (block - 1)
    return -(-rows // block)


def expert_plan(tokens: int, top_k: int, num_experts: int) -> int:
    """``DENSE`` or the block size of the grouped computation for ``tokens`` rows."""
    r = _WEIGHT_READ_ROWS
    best, best_cost = DENSE, num_experts * max(tokens, r)
    for block in _BLOCK_SIZES:
        cost = grouped_blocks(tokens, top_k, num_experts, block) * (max(block, r) + 2 * r)
        if cost < best_cost:
            best, best_cost = block, cost
    return best


Activation = Callable[[torch.Tensor], torch.Tensor]  # [..., 2I] gate then up -> [..., I]


def clamped_swiglu(x: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert activation on ``[..., 2I]`` (gate then up) -> ``[..., I]``: the gate
    clamped from above, the up projection both ways, ``(up + 1) * g * sigmoid(alpha * g)``
    (rounded where transformers rounds)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def dense_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, ops: TorchLayerOps,
                  b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                  act_fn: Activation | None = None, scale_inputs: bool = False
                  ) -> torch.Tensor:
    """x ``[T, H]``, routing ``weights``/``ids`` ``[T, k]`` -> ``[T, H]``: all experts."""
    tokens, hidden = x.shape
    num_experts, inter2, _ = w_gate_up.shape
    gate_up = F.linear(x, w_gate_up.view(num_experts * inter2, hidden),
                       None if b_gate_up is None else b_gate_up.view(-1))  # [T, E * 2I]
    gate_up = gate_up.view(tokens, num_experts, inter2)
    dense_weights = torch.zeros(tokens, num_experts, dtype=x.dtype, device=x.device)
    dense_weights.scatter_(1, ids, weights)  # [T, E], zero where an expert was not picked
    activation = act_fn or ops.silu_and_mul
    if scale_inputs:  # silu(0) * 0 = 0: the experts not picked still add nothing
        return activation(gate_up * dense_weights.unsqueeze(-1)).view(tokens, -1) \
            @ w_down.view(-1, hidden)
    act = activation(gate_up) * dense_weights.unsqueeze(-1)  # [T, E, I]
    out = act.view(tokens, -1) @ w_down.view(-1, hidden)  # sums over experts too
    return out if b_down is None else out + dense_weights @ b_down


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor, ops: TorchLayerOps,
                    block: int, b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None,
                    act_fn: Activation | None = None, scale_inputs: bool = False
                    ) -> torch.Tensor:
    """x ``[T, H]``, routing ``weights``/``ids`` ``[T, k]`` -> ``[T, H]``: the picked
    experts only, in blocks of ``block`` rows of one expert each."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts = w_gate_up.shape[0]
    n = tokens * top_k
    flat_ids = ids.reshape(n)
    num_blocks = grouped_blocks(tokens, top_k, num_experts, block)
    if block == 1:  # one assignment per block, in assignment order: nothing to sort
        rows = None
        block_expert = flat_ids
        xs = x.repeat_interleave(top_k, dim=0)  # assignment t * k + j is token t
        row_weights = weights.reshape(n, 1, 1)
    else:
        rows, block_expert = _sort_into_blocks(flat_ids, num_experts, block, num_blocks)
        xs = x.new_zeros(num_blocks * block, hidden)
        xs.index_copy_(0, rows, x.repeat_interleave(top_k, dim=0))
        row_weights = x.new_zeros(num_blocks * block)
        row_weights.index_copy_(0, rows, weights.reshape(n))
        row_weights = row_weights.view(num_blocks, block, 1)
    gate_up = torch.bmm(xs.view(num_blocks, block, hidden),
                        w_gate_up.index_select(0, block_expert).transpose(1, 2))
    if b_gate_up is not None:
        gate_up = gate_up + b_gate_up.index_select(0, block_expert).unsqueeze(1)
    activation = act_fn or ops.silu_and_mul
    # padding rows: zero weight (their biased activations are not zero); scale_inputs
    # (Llama 4) weighs the inputs instead, so padding rows are zero in as well
    act = (activation(gate_up * row_weights) if scale_inputs
           else activation(gate_up) * row_weights)
    out = torch.bmm(act, w_down.index_select(0, block_expert))  # [blocks, M, H]
    if b_down is not None:
        out = out + b_down.index_select(0, block_expert).unsqueeze(1) * row_weights
    out = out.view(-1, hidden)
    if rows is not None:
        out = out.index_select(0, rows)  # back to assignment order
    return out.view(tokens, top_k, hidden).sum(dim=1)


def _sort_into_blocks(flat_ids: torch.Tensor, num_experts: int, block: int, num_blocks: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each assignment in the padded expert-sorted layout ``[n]``, expert of each
    block ``[num_blocks]``); shapes depend on ``n`` and the sizes only."""
    n = flat_ids.shape[0]
    device = flat_ids.device
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block - 1) // block * block
    start = counts.cumsum(0) - counts  # first sorted position of each expert
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded  # first row of each expert in the padded layout
    sorted_ids = flat_ids.index_select(0, order)
    sorted_rows = (padded_start.index_select(0, sorted_ids)
                   + torch.arange(n, device=device) - start.index_select(0, sorted_ids))
    rows = torch.empty_like(sorted_rows).scatter_(0, order, sorted_rows)
    block_starts = torch.arange(num_blocks, device=device) * block
    # the expert whose padded range holds each block's first row; blocks past the last
    # expert's are all padding and borrow the last expert's weights
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    return rows, block_expert.clamp_(max=num_experts - 1)


class SparseMoeBlock(nn.Module):
    """Drop-in for ``MLP`` in a sparse layer: ``[..., H] -> [..., H]``; ``shared``: an MLP
    every token goes through besides its routed experts (DeepSeek's shared experts)."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.router = cfg.moe_router  # see moe_routing.py
        # DeepSeek-V3's per-expert bias of the choice (the checkpoint's
        # gate.e_score_correction_bias)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.num_experts))
                                        if self.router.score_bias else None)
        self.shared_experts = shared
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=cfg.moe_bias)  # the router
        self.w_gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * inter, hidden))
        self.w_down = nn.Parameter(torch.empty(cfg.num_experts, inter, hidden))
        # gpt-oss: each expert's biases (gate rows then up rows, as w_gate_up)
        self.b_gate_up = (nn.Parameter(torch.empty(cfg.num_experts, 2 * inter))
                          if cfg.moe_bias else None)
        self.b_down = nn.Parameter(torch.empty(cfg.num_experts, hidden)) if cfg.moe_bias else None
        self.act_fn: Activation | None = (
            partial(clamped_swiglu, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
            if cfg.swiglu_limit is not None else None)  # None: the ops' SiLU-and-mul
        self.ops: TorchLayerOps = TorchLayerOps()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, H]`` -> (weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``)."""
        bias = self.e_score_correction_bias
        weights, ids = route(self.gate(x).float(), self.top_k, self.renormalize, self.router,
                             bias.float() if bias is not None else None)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        plan = expert_plan(x.shape[0], self.top_k, self.num_experts)
        biases = dict(b_gate_up=self.b_gate_up, b_down=self.b_down, act_fn=self.act_fn)
        if plan == DENSE:
            out = dense_experts(x, self.w_gate_up, self.w_down, weights, ids, self.ops,
                                **biases)
        else:
            out = grouped_experts(x, self.w_gate_up, self.w_down, weights, ids, self.ops, plan,
                                  **biases)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
