"""Paged attention written with static-shape PyTorch ops only.

Every tensor's shape depends on the padded batch shape alone (``[bs, q]`` for prefill,
``(bs, num_blocks)`` for decode), never on the data, so one compiled/captured graph per
bucket covers every batch padded to it. Decode is the "flat paged attention" of vLLM's Gaudi
backend: the blocks of all sequences form one flat list, a one-hot ``block_mapping`` matrix
turns per-sequence reductions into dense matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Device tensors describing where a padded batch's K/V live.

    Layout of the KV cache (per layer): K and V are ``[num_slots, num_kv_heads, head_dim]``
    with ``num_slots = (num_blocks + 1) * block_size``; block ``num_blocks`` is the padding
    block that pad tokens write into and pad entries read from (no negative indices).
    """

    is_prompt: bool
    block_size: int
    # [bs * q] cache slot of every input token (prefill) or [bs] (decode); pads -> pad block
    slot_mapping: torch.Tensor
    # decode only, N = padded number of blocks of the whole batch:
    block_list: torch.Tensor | None = None  # [N] physical block ids, pad = pad block
    block_groups: torch.Tensor | None = None  # [N] owning row in the batch, pad = bs
    block_mapping: torch.Tensor | None = None  # [N, bs] one-hot of block_groups, model dtype
    block_bias: torch.Tensor | None = None  # [N, block_size] 0 for valid slots, -inf-ish else


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V (``[T, Hkv, D]``) into their cache slots, one op per tensor."""
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention over a right-padded ``[bs, q]`` batch with no prior context.

    query ``[bs, q, Hq, D]``, key/value ``[bs, q, Hkv, D]`` -> ``[bs, q, Hq, D]``. A causal
    mask alone is enough: real tokens sit left of the padding and so never see it; pad rows
    compute finite garbage that nobody reads.
    """
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2)


def flat_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One decode token per row attending over its blocks. query ``[bs, Hq, D]`` -> same.

    Per-block partial softmax, then a cross-block renormalisation using the sequence-wide
    max (scatter amax by group) and sums via ``block_mapping`` matmuls.
    """
    assert meta.block_list is not None and meta.block_mapping is not None
    assert meta.block_bias is not None and meta.block_groups is not None
    bs, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_q_heads // num_kv_heads
    block_size = meta.block_size
    num_blocks = meta.block_list.shape[0]

    # batch2block: every block gets its sequence's query.
    q_blk = meta.block_mapping @ (query * scale).reshape(bs, num_q_heads * head_dim)
    q_blk = q_blk.view(num_blocks, num_kv_heads, groups, head_dim)

    k_blocks = k_cache.view(-1, block_size, num_kv_heads, head_dim)
    v_blocks = v_cache.view(-1, block_size, num_kv_heads, head_dim)
    keys = k_blocks.index_select(0, meta.block_list).permute(0, 2, 3, 1)  # [N, Hkv, D, B]
    values = v_blocks.index_select(0, meta.block_list).transpose(1, 2)  # [N, Hkv, B, D]

    scores = torch.matmul(q_blk, keys).float()  # [N, Hkv, G, B]
    scores = scores + meta.block_bias.view(num_blocks, 1, 1, block_size)
    block_max = scores.amax(dim=-1)  # [N, Hkv, G]

    # Sequence-wide max per (row, head): scatter amax into bs+1 rows (pad blocks -> row bs).
    seq_max = torch.full(
        (bs + 1, num_kv_heads, groups), float("-inf"), dtype=scores.dtype, device=scores.device
    )
    index = meta.block_groups.view(-1, 1, 1).expand(-1, num_kv_heads, groups)
    seq_max = seq_max.scatter_reduce(0, index, block_max, reduce="amax", include_self=True)
    block_seq_max = seq_max.index_select(0, meta.block_groups)  # [N, Hkv, G]

    probs = torch.exp(scores - block_seq_max.unsqueeze(-1))  # [N, Hkv, G, B]
    block_sum = probs.sum(dim=-1)  # [N, Hkv, G]
    out_blk = torch.matmul(probs.to(values.dtype), values)  # [N, Hkv, G, D]

    mapping = meta.block_mapping
    seq_sum = mapping.t().float() @ block_sum.view(num_blocks, -1)  # [bs, Hkv*G]
    out = mapping.t() @ out_blk.reshape(num_blocks, -1)  # block2batch: [bs, Hkv*G*D]
    out = out.view(bs, num_kv_heads * groups, head_dim).float()
    # Pad rows have no blocks: guard their zero sum instead of dividing by it.
    out = out / seq_sum.clamp_min(1e-30).view(bs, num_kv_heads * groups, 1)
    return out.to(query.dtype)
