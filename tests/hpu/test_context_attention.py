"""Prefill after a context in the cache (cached prefix, earlier chunks of a prompt): the
flash + log-sum-exp merge against dense causal attention over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from server.hpu.attention import (
    AttentionMetadata,
    context_prefill_attention,
    paged_prefill_attention,
    write_kv,
)

BLOCK, HKV, GROUPS, D = 4, 2, 3, 8
HQ = HKV * GROUPS


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                 scale: float) -> torch.Tensor:
    """Queries ``[n, Hq, D]`` at positions start.. over keys ``[start + n, Hkv, D]``."""
    k = k.repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [Hq, T, D]
    v = v.repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, n, T]
    pos_q = torch.arange(q.shape[0]).unsqueeze(1) + start
    visible = torch.arange(k.shape[1]).unsqueeze(0) <= pos_q
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)  # [n, Hq, D]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("contexts, news", [
    ([8, 0, 5, 12], [3, 6, 2, 6]),  # block-aligned, none, mid-block, several blocks
    ([4], [9]),  # a single context block (a strided view once gathered)
])
def test_context_prefill_matches_dense_causal(transposed: bool, contexts: list[int],
                                              news: list[int]) -> None:
    torch.manual_seed(0)
    q_len = max(news)  # rows right-padded to 6
    bs = len(contexts)
    num_blocks = 40
    k_cache = torch.zeros(num_blocks + 1, HKV, BLOCK, D)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.full((bs, 5), num_blocks, dtype=torch.long)
    full_k, full_v = [], []
    next_block = 0
    slots = []
    for row, (ctx, new) in enumerate(zip(contexts, news)):
        n_blocks = -(-(ctx + q_len) // BLOCK)
        tables[row, :n_blocks] = torch.arange(next_block, next_block + n_blocks)
        next_block += n_blocks
        full_k.append(torch.randn(ctx + new, HKV, D))
        full_v.append(torch.randn(ctx + new, HKV, D))
        for pos in range(ctx + q_len):
            block = int(tables[row, pos // BLOCK])
            slots.append(block * BLOCK + pos % BLOCK)
    # write the contexts, as earlier steps would have
    for row, ctx in enumerate(contexts):
        for pos in range(ctx):
            block = int(tables[row, pos // BLOCK])
            k_cache[block, :, pos % BLOCK] = full_k[row][pos]
            v_cache[block, :, pos % BLOCK] = full_v[row][pos]
    query = torch.randn(bs, q_len, HQ, D)
    key = torch.zeros(bs, q_len, HKV, D)
    value = torch.zeros_like(key)
    for row, (ctx, new) in enumerate(zip(contexts, news)):
        key[row, :new] = full_k[row][ctx:]
        value[row, :new] = full_v[row][ctx:]
    starts = torch.tensor(contexts)
    positions = starts.unsqueeze(1) + torch.arange(q_len)
    slot_mapping = (tables.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK)
    meta = AttentionMetadata(True, BLOCK, slot_mapping.reshape(-1), has_context=True,
                             context_tables=tables, context_lens=starts,
                             total_lens=starts + torch.tensor(news),
                             host_context_lens=contexts)
    write_kv(k_cache, v_cache, key.reshape(-1, HKV, D), value.reshape(-1, HKV, D), meta)
    scale = D**-0.5
    reference = paged_prefill_attention(query, k_cache, v_cache, meta, scale)
    k_arg = k_cache.transpose(2, 3).contiguous() if transposed else k_cache
    out = context_prefill_attention(query, key, value, k_arg, v_cache, meta, scale,
                                    keys_transposed=transposed)
    for row, (ctx, new) in enumerate(zip(contexts, news)):
        expected = dense_causal(query[row, :new], full_k[row], full_v[row], ctx, scale)
        torch.testing.assert_close(out[row, :new], expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(reference[row, :new], expected, atol=1e-5, rtol=1e-4)
