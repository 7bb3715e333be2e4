"""Attention sinks (gpt-oss) in every PyTorch attention path: prompt, paged prefill after a
cached prefix, flat decode, against one naive reference whose softmax has the sink logit
as an extra column; with and without a sliding window. (The fused CPU kernel's sinks are
tested in tests/hpu/cpu/test_cpu_kernel_variants.py.)"""

from __future__ import annotations

import pytest
import torch

from server.hpu.attention import (
    AttentionMetadata,
    flat_paged_attention,
    paged_prefill_attention,
    prompt_attention,
)
from server.hpu.types import DecodeLayout
from tests.hpu.test_attention import BLOCK, GROUPS, HKV, D, scattered_cache, token_slots

SCALE = D**-0.5


def naive_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: int,
                     window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] at q_pos against keys at positions 0..T-1: transformers' gpt-oss eager
    attention (the sink a score column of its own, dropped after the softmax)."""
    k = k.double().repeat_interleave(GROUPS, dim=1).transpose(0, 1)  # [Hq, T, D]
    v = v.double().repeat_interleave(GROUPS, dim=1).transpose(0, 1)
    scores = (q.double().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * SCALE  # [Hq, T]
    pos = torch.arange(k.shape[1])
    visible = (pos <= q_pos) & ((pos > q_pos - window) if window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.cat([scores, sinks.double().view(-1, 1)], dim=-1).softmax(-1)[:, :-1]
    return (probs.unsqueeze(1) @ v).squeeze(1).float()


def random_sinks() -> torch.Tensor:
    # spread so that some heads' sinks dominate and others barely count
    return torch.linspace(-3.0, 4.0, HKV * GROUPS)


@pytest.mark.parametrize("window", [None, 3, 5])
def test_prompt_attention_with_sinks(window: int | None) -> None:
    torch.manual_seed(3)
    q = torch.randn(2, 12, HKV * GROUPS, D)
    k, v = torch.randn(2, 12, HKV, D), torch.randn(2, 12, HKV, D)
    sinks = random_sinks()
    out = prompt_attention(q, k, v, SCALE, None, window, sinks=sinks)
    plain = prompt_attention(q, k, v, SCALE, None, window)
    assert (out - plain).abs().max() > 1e-2  # the sinks change the answer
    for row in range(2):
        for t in range(12):
            ref = naive_with_sinks(q[row, t], k[row], v[row], t, window, sinks)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 9])
def test_flat_decode_with_sinks(window: int | None) -> None:
    from server.engine.worker.input_builder import InputBuilder

    torch.manual_seed(5)
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache([1, 4, 5, 11, 17, 26])
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    blocks = sum(len(s.block_table) for s in seqs)
    inputs = builder.decode(seqs, pad_to=(len(seqs) + 2, blocks + 3))  # bucket padding
    query = torch.randn(len(seqs) + 2, HKV * GROUPS, D) * 3
    sinks = random_sinks()
    out = flat_paged_attention(query, k_cache, v_cache, inputs.meta, SCALE, None, window,
                               sinks=sinks)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        ref = naive_with_sinks(query[row], k_rows[slots], v_rows[slots], seq.num_tokens - 1,
                               window, sinks)
        torch.testing.assert_close(out[row], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()  # pad rows too


def test_flat_decode_sink_far_above_the_scores_stays_finite() -> None:
    """A sink 200 above every score: its exp is taken against the running max that starts
    at the sink, so nothing overflows; the output is ~0 (the sink takes all the weight)."""
    from server.engine.worker.input_builder import InputBuilder

    bm, seqs, (k_cache, v_cache), _ = scattered_cache([5, 9])
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    inputs = builder.decode(seqs, pad_to=(2, 5))
    query = torch.randn(2, HKV * GROUPS, D)
    out = flat_paged_attention(query, k_cache, v_cache, inputs.meta, SCALE,
                               sinks=torch.full((HKV * GROUPS,), 200.0))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-30


@pytest.mark.parametrize("window", [None, 3, 7])
def test_paged_prefill_with_sinks(window: int | None) -> None:
    torch.manual_seed(6)
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
    sinks = random_sinks()
    out = paged_prefill_attention(query, k_cache, v_cache, meta, SCALE, None, window,
                                  sinks=sinks)
    for row, seq in enumerate(seqs):
        slots = token_slots(seq)
        for t in range(totals[row] - contexts[row]):
            ref = naive_with_sinks(query[row, t], k_rows[slots], v_rows[slots],
                                   contexts[row] + t, window, sinks)
            torch.testing.assert_close(out[row, t], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("window", [None, 5])
def test_verify_step_with_sinks(window: int | None) -> None:
    """A speculative verify step (each row's last token and its drafts, rows with fewer
    drafts padded): query t of a row at position first + t sees keys up to it."""
    from server.engine.worker.input_builder import InputBuilder
    from server.hpu.attention import flat_paged_verify_attention

    torch.manual_seed(8)
    lens, drafts = [3, 9, 14], [[5, 6], [], [7]]
    # blocks for the drafts' positions too, then the sequences as they stand before them
    bm, seqs, (k_cache, v_cache), (k_rows, v_rows) = scattered_cache(
        [n + len(d) for n, d in zip(lens, drafts)])
    for seq, n in zip(seqs, lens):
        del seq.prompt_token_ids[n:]
    q = 1 + max(len(d) for d in drafts)
    builder = InputBuilder(BLOCK, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096,
                           DecodeLayout.FLAT)
    blocks = sum(len(s.block_table) for s in seqs)
    inputs = builder.verify(seqs, drafts, pad_to=(len(seqs) + 1, q, blocks + 2))
    query = torch.randn((len(seqs) + 1) * q, HKV * GROUPS, D) * 3
    sinks = random_sinks()
    out = flat_paged_verify_attention(query, k_cache, v_cache, inputs.meta, SCALE, None,
                                      window, sinks=sinks)
    for row, (seq, extra) in enumerate(zip(seqs, drafts)):
        slots = [seq.block_table[t // BLOCK] * BLOCK + t % BLOCK
                 for t in range(seq.num_tokens + len(extra))]
        for t in range(1 + len(extra)):
            ref = naive_with_sinks(query[row * q + t], k_rows[slots], v_rows[slots],
                                   seq.num_tokens - 1 + t, window, sinks)
            torch.testing.assert_close(out[row * q + t], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()
