"""Flat paged attention against a dense reference, including bucket-style padding."""

from __future__ import annotations

import random

import pytest
import torch

from server.engine.core.block_manager import BlockManager
from server.engine.core.sequence import Sequence
from server.engine.sampling_params import SamplingParams
from server.hpu.attention import AttentionMetadata, flat_paged_attention, prompt_attention
from server.hpu.types import DecodeLayout

BLOCK, HKV, GROUPS, D = 4, 2, 3, 8


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Hq, D] against k/v [T, Hkv, D] for one sequence."""
    k = k.repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [Hq, T, D]
    v = v.repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    probs = torch.softmax((q.unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
    return (probs @ v).squeeze(1)


@pytest.mark.parametrize("pad_rows, pad_blocks", [(0, 0), (3, 0), (0, 5), (2, 7)])
def test_flat_paged_attention_matches_dense(pad_rows: int, pad_blocks: int) -> None:
    from server.engine.worker.input_builder import InputBuilder

    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 32
    bm = BlockManager(num_blocks, BLOCK)
    # Shuffle the free list so block tables are scattered, as after churn.
    free = list(bm._free)
    rng.shuffle(free)
    bm._free.clear()
    bm._free.extend(free)
    k_cache = torch.randn(num_blocks + 1, HKV, BLOCK, D)
    v_cache = torch.randn(num_blocks + 1, HKV, BLOCK, D)
    # the same cache as token rows [slot, Hkv, D], for the dense reference
    k_rows = k_cache.transpose(1, 2).reshape(-1, HKV, D)
    v_rows = v_cache.transpose(1, 2).reshape(-1, HKV, D)
    seqs = []
    for i, n in enumerate([1, 4, 5, 11, 17]):
        seq = Sequence(i, str(i), 0, [1] * n, SamplingParams(), 0.0)
        bm.allocate(seq)
        seqs.append(seq)
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    num_real_blocks = sum(len(s.block_table) for s in seqs)
    pad_to = (len(seqs) + pad_rows, num_real_blocks + pad_blocks)
    inputs = builder.decode(seqs, pad_to=pad_to)
    query = torch.randn(pad_to[0], HKV * GROUPS, D)
    out = flat_paged_attention(query, k_cache, v_cache, inputs.meta, scale=D**-0.5)
    assert out.shape == query.shape
    for row, seq in enumerate(seqs):
        slots = [seq.block_table[t // BLOCK] * BLOCK + t % BLOCK for t in range(seq.num_tokens)]
        ref = dense_attention(query[row], k_rows[slots], v_rows[slots], D**-0.5)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()  # padding rows stay finite too
    # padding must only ever touch the pad block
    pad_slots = inputs.meta.slot_mapping[len(seqs):]
    assert bool(((pad_slots // BLOCK) == bm.pad_block_id).all())


def test_prompt_attention_is_causal_and_ignores_right_padding() -> None:
    torch.manual_seed(1)
    q = torch.randn(2, 6, HKV * GROUPS, D)
    k = torch.randn(2, 6, HKV, D)
    v = torch.randn(2, 6, HKV, D)
    out = prompt_attention(q, k, v, D**-0.5)
    # row 1 has 3 real tokens: changing its padded tail must not change them
    k2, v2 = k.clone(), v.clone()
    k2[1, 3:] = 100.0
    v2[1, 3:] = -100.0
    out2 = prompt_attention(q, k2, v2, D**-0.5)
    torch.testing.assert_close(out[1, :3], out2[1, :3])
    for t in range(6):
        ref = dense_attention(q[0, t], k[0, : t + 1], v[0, : t + 1], D**-0.5)
        torch.testing.assert_close(out[0, t], ref, atol=1e-5, rtol=1e-5)


def test_write_kv_lands_in_block_offset_and_nowhere_else() -> None:
    from server.hpu.attention import AttentionMetadata, write_kv

    torch.manual_seed(2)
    k_cache, v_cache = torch.zeros(6, HKV, BLOCK, D), torch.zeros(6, HKV, BLOCK, D)
    slots = torch.tensor([0, 5, 7, 22, 13])  # blocks 0, 1, 1, 5, 3
    key, value = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    write_kv(k_cache, v_cache, key, value, AttentionMetadata(True, BLOCK, slots))
    for i, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(k_cache[slot // BLOCK, :, slot % BLOCK], key[i])
        torch.testing.assert_close(v_cache[slot // BLOCK, :, slot % BLOCK], value[i])
    assert int((k_cache.abs().sum(dim=(1, 3)) > 0).sum()) == len(slots)


# Sliding windows: every path against one naive reference over absolute positions.

def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: int,
                    scale: float, window: int | None, softcap: float | None = None,
                    chunk: int | None = None) -> torch.Tensor:
    """q [Hq, D] at position q_pos against the keys at positions 0..T-1 ([T, Hkv, D]):
    key k is visible iff q_pos - window < k <= q_pos (transformers' sliding window) and
    k // chunk == q_pos // chunk (Llama 4's chunked attention)."""
    k = k.repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [Hq, T, D]
    v = v.repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    scores = (q.unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [Hq, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(k.shape[1])
    visible = (pos <= q_pos) & ((pos > q_pos - window) if window is not None else True)
    if chunk is not None:
        visible = visible & (pos // chunk == q_pos // chunk)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return (probs.unsqueeze(1) @ v).squeeze(1)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 3, 5, 16])
def test_windowed_prompt_attention_matches_naive(window: int, softcap: float | None) -> None:
    torch.manual_seed(3)
    q = torch.randn(2, 12, HKV * GROUPS, D)
    k, v = torch.randn(2, 12, HKV, D), torch.randn(2, 12, HKV, D)
    out = prompt_attention(q, k, v, D**-0.5, softcap, window)
    for row in range(2):
        for t in range(12):
            ref = naive_attention(q[row, t], k[row], v[row], t, D**-0.5, window, softcap)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)


def scattered_cache(seq_lens: list[int], num_blocks: int = 40):
    """A block manager with shuffled free blocks, sequences of these lengths allocated,
    random caches and the same caches as token rows ``[slot, Hkv, D]``."""
    bm = BlockManager(num_blocks, BLOCK)
    free = list(bm._free)
    random.Random(4).shuffle(free)
    bm._free.clear()
    bm._free.extend(free)
    seqs = []
    for i, n in enumerate(seq_lens):
        seq = Sequence(i, str(i), 0, [1] * n, SamplingParams(), 0.0)
        bm.allocate(seq)
        seqs.append(seq)
    k_cache = torch.randn(num_blocks + 1, HKV, BLOCK, D)
    v_cache = torch.randn(num_blocks + 1, HKV, BLOCK, D)
    rows = (k_cache.transpose(1, 2).reshape(-1, HKV, D),
            v_cache.transpose(1, 2).reshape(-1, HKV, D))
    return bm, seqs, (k_cache, v_cache), rows


def token_slots(seq: Sequence) -> list[int]:
    return [seq.block_table[t // BLOCK] * BLOCK + t % BLOCK for t in range(seq.num_tokens)]


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 4, 6, 9, 64])
def test_windowed_flat_decode_matches_naive(window: int, softcap: float | None) -> None:
    from server.engine.worker.input_builder import InputBuilder

    torch.manual_seed(5)
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache([1, 4, 5, 11, 17, 26])
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    blocks = sum(len(s.block_table) for s in seqs)
    inputs = builder.decode(seqs, pad_to=(len(seqs) + 2, blocks + 3))  # bucket padding
    query = torch.randn(len(seqs) + 2, HKV * GROUPS, D)
    out = flat_paged_attention(query, k_cache, v_cache, inputs.meta, D**-0.5, softcap, window)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        ref = naive_attention(query[row], k_rows[slots], v_rows[slots], seq.num_tokens - 1,
                              D**-0.5, window, softcap)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [1, 3, 7, 64])
def test_windowed_paged_prefill_matches_naive(window: int, softcap: float | None) -> None:
    """Queries after a cached prefix (the prefill of prefix caching), rows right-padded."""
    from server.hpu.attention import paged_prefill_attention

    torch.manual_seed(6)
    totals, contexts = [9, 22, 13], [4, 16, 0]
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache(totals)
    # pad query columns further past each row's end than the window reaches
    q_len = max(t - c for t, c in zip(totals, contexts)) + 8
    width = max(len(s.block_table) for s in seqs)
    tables = torch.full((len(seqs), width), bm.pad_block_id)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table)
    meta = AttentionMetadata(True, BLOCK, torch.zeros(1, dtype=torch.long),
                             has_context=True, context_tables=tables,
                             context_lens=torch.tensor(contexts), total_lens=torch.tensor(totals))
    query = torch.randn(len(seqs), q_len, HKV * GROUPS, D)
    out = paged_prefill_attention(query, k_cache, v_cache, meta, D**-0.5, softcap, window)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        for t in range(totals[row] - contexts[row]):
            ref = naive_attention(query[row, t], k_rows[slots], v_rows[slots],
                                  contexts[row] + t, D**-0.5, window, softcap)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)
    # pad queries' values land in the padding block, which every masked slot multiplies by
    # zero: a NaN there would spread
    assert torch.isfinite(out).all()


# Chunked attention (Llama 4): every path against the same naive reference, chunks shorter
# and longer than a block, alone and with a window

CHUNKS = [(3, None), (4, None), (8, None), (6, 4)]  # (chunk, window)


@pytest.mark.parametrize("chunk, window", CHUNKS)
def test_chunked_prompt_attention_matches_naive(chunk: int, window: int | None) -> None:
    torch.manual_seed(7)
    q = torch.randn(2, 20, HKV * GROUPS, D)
    k, v = torch.randn(2, 20, HKV, D), torch.randn(2, 20, HKV, D)
    out = prompt_attention(q, k, v, D**-0.5, None, window, chunk)
    for row in range(2):
        for t in range(20):
            ref = naive_attention(q[row, t], k[row], v[row], t, D**-0.5, window, None, chunk)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk, window", CHUNKS)
def test_chunked_flat_decode_matches_naive(chunk: int, window: int | None) -> None:
    from server.engine.worker.input_builder import InputBuilder

    torch.manual_seed(8)
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache([1, 4, 5, 9, 17, 26])
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    blocks = sum(len(s.block_table) for s in seqs)
    inputs = builder.decode(seqs, pad_to=(len(seqs) + 2, blocks + 3))
    query = torch.randn(len(seqs) + 2, HKV * GROUPS, D)
    out = flat_paged_attention(query, k_cache, v_cache, inputs.meta, D**-0.5, None, window,
                               chunk)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        ref = naive_attention(query[row], k_rows[slots], v_rows[slots], seq.num_tokens - 1,
                              D**-0.5, window, None, chunk)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("chunk, window", CHUNKS)
def test_chunked_paged_prefill_matches_naive(chunk: int, window: int | None) -> None:
    from server.hpu.attention import paged_prefill_attention

    torch.manual_seed(9)
    totals, contexts = [9, 22, 13], [4, 16, 0]
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache(totals)
    q_len = max(t - c for t, c in zip(totals, contexts)) + 8
    width = max(len(s.block_table) for s in seqs)
    tables = torch.full((len(seqs), width), bm.pad_block_id)
    for row, seq in enumerate(seqs):
        tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table)
    meta = AttentionMetadata(True, BLOCK, torch.zeros(1, dtype=torch.long),
                             has_context=True, context_tables=tables,
                             context_lens=torch.tensor(contexts), total_lens=torch.tensor(totals))
    query = torch.randn(len(seqs), q_len, HKV * GROUPS, D)
    out = paged_prefill_attention(query, k_cache, v_cache, meta, D**-0.5, None, window, chunk)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        for t in range(totals[row] - contexts[row]):
            ref = naive_attention(query[row, t], k_rows[slots], v_rows[slots],
                                  contexts[row] + t, D**-0.5, window, None, chunk)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("chunk, window", CHUNKS)
def test_chunked_verify_matches_naive(chunk: int, window: int | None) -> None:
    """A speculative verify step: each row's last token and its drafts, the drafts
    crossing chunk boundaries, one row with fewer drafts (pad queries), padded blocks."""
    from server.engine.worker.input_builder import InputBuilder
    from server.hpu.attention import flat_paged_verify_attention

    torch.manual_seed(10)
    totals, drafts = [7, 15, 26], [3, 3, 1]
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache(totals)
    verifying = []  # the same blocks, the drafts' tokens not counted yet
    for seq, d in zip(seqs, drafts):
        v_seq = Sequence(seq.seq_id, "v", 0, [1] * (seq.num_tokens - d), SamplingParams(), 0.0)
        v_seq.block_table = seq.block_table
        verifying.append(v_seq)
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    q = 1 + max(drafts)
    blocks = sum(len(s.block_table) for s in seqs)
    inputs = builder.verify(verifying, [[0] * d for d in drafts], (len(seqs) + 1, q, blocks + 2))
    query = torch.randn((len(seqs) + 1) * q, HKV * GROUPS, D)
    out = flat_paged_verify_attention(query, k_cache, v_cache, inputs.meta, D**-0.5, None,
                                      window, chunk)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        first = verifying[row].num_tokens - 1
        for i in range(1 + drafts[row]):
            ref = naive_attention(query[row * q + i], k_rows[slots], v_rows[slots], first + i,
                                  D**-0.5, window, None, chunk)
            torch.testing.assert_close(out[row * q + i], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
