"""The tiled prefill attention kernel (csrc/prefill_attention.cpp) against a float64 dense
causal reference: prompt chunks after a context and without one, several block sizes, GQA
groups and head sizes, bf16 and fp32, decode rows and short runs beside the tiled ones, and
which prompt steps the fused layer ops send to it."""

from __future__ import annotations

import random

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.layer_ops import FusedCpuLayerOps

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def fused() -> FusedCpuLayerOps:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    return FusedCpuLayerOps()


class Batch:
    """Sequences in a shared paged cache (scattered blocks) and packed query rows: each
    (sequence, first position, count) adds `count` consecutive tokens of that sequence."""

    def __init__(self, dtype: torch.dtype, kv_heads: int, groups: int, dim: int, block: int,
                 seq_lens: list[int], chunks: list[tuple[int, int, int]], seed: int) -> None:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        free = list(range(sum(-(-n // block) for n in seq_lens) + 3))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
        num_blocks = max(max(t) for t in self.tables) + 1
        self.k = (torch.randn(num_blocks + 1, kv_heads, block, dim) * 2).to(dtype)
        self.v = torch.randn_like(self.k, dtype=torch.float32).to(dtype)
        self.keys_t = self.k.transpose(2, 3).contiguous()  # the kernels' key layout
        width = max(len(t) for t in self.tables)
        self.rows: list[tuple[int, int]] = []  # (sequence, tokens it sees)
        for seq, first, count in chunks:
            self.rows += [(seq, first + t + 1) for t in range(count)]
        self.block_tables = torch.tensor(
            [self.tables[s] + [num_blocks] * (width - len(self.tables[s])) for s, _ in self.rows],
            dtype=torch.int32)
        self.seq_lens = torch.tensor([n for _, n in self.rows], dtype=torch.int32)
        # queries as the model passes them: a strided view into a fused qkv row
        qkv = torch.randn(len(self.rows), (kv_heads * groups + 2 * kv_heads) * dim, dtype=dtype)
        self.query = qkv.view(len(self.rows), -1, dim)[:, : kv_heads * groups]
        self.scale = dim**-0.5
        self.kv_heads, self.groups, self.dim = kv_heads, groups, dim

    def reference(self) -> torch.Tensor:
        """Dense causal attention in float64, one sequence's rows at a time."""
        out = torch.empty(self.query.shape, dtype=torch.float64)
        seqs = torch.tensor([s for s, _ in self.rows])
        lens = self.seq_lens.long()
        for seq in seqs.unique().tolist():
            rows = (seqs == seq).nonzero().flatten()
            blocks = torch.tensor(self.tables[seq])

            def dense(cache: torch.Tensor) -> torch.Tensor:  # [tokens, Hq, D]
                flat = cache[blocks].double().transpose(1, 2).reshape(-1, self.kv_heads, self.dim)
                return flat.repeat_interleave(self.groups, dim=1)

            k, v = dense(self.k), dense(self.v)
            scores = torch.einsum("rhd,nhd->rhn", self.query[rows].double(), k) * self.scale
            hidden = torch.arange(k.shape[0])[None, :] >= lens[rows][:, None]  # [rows, n]
            scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
            out[rows] = torch.einsum("rhn,nhd->rhd", scores.softmax(-1), v)
        return out

    def run(self, min_run: int = 16) -> torch.Tensor:
        return torch.ops.hpu_serve.prefill_attention(self.query, self.keys_t, self.v,
                                                     self.block_tables, self.seq_lens,
                                                     self.scale, min_run)


def assert_close(dtype: torch.dtype, out: torch.Tensor, want: torch.Tensor) -> None:
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (3, 3, 64, 16),  # SmolLM2
    (2, 4, 128, 32),  # Llama-3 shaped
    (1, 1, 64, 64),  # MHA, large blocks
    (2, 7, 64, 16)])  # a group count whose rows leave every register-block remainder
@pytest.mark.parametrize("context, count", [(0, 16), (0, 100), (37, 64), (300, 45),
                                            (130, 200)])
def test_prompt_chunk_matches_dense(fused, dtype, kv_heads, groups, dim, block, context,
                                    count) -> None:
    """One sequence's chunk of `count` tokens after `context` cached ones: partial key
    tiles, query tiles that straddle the diagonal, tiles of fewer than 32 tokens."""
    batch = Batch(dtype, kv_heads, groups, dim, block, [context + count],
                  [(0, context, count)], seed=context + count + dim)
    out = batch.run()
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert_close(dtype, out, batch.reference())


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_step_with_decodes_and_short_runs(fused, dtype) -> None:
    """A packed eager step: two prompt chunks (tiled), a short chunk and decode rows of other
    sequences (sent on to the paged kernel), in one call; the rows land in their places."""
    batch = Batch(dtype, 3, 3, 64, 16, [90, 200, 7, 51, 300],
                  [(0, 89, 1), (1, 10, 150), (2, 0, 7), (3, 50, 1), (4, 260, 40)], seed=7)
    assert_close(dtype, batch.run(), batch.reference())
    # every row tiled (min_run 1) or none (a run longer than any): the same values
    assert_close(dtype, batch.run(min_run=1), batch.reference())
    assert_close(dtype, batch.run(min_run=10_000), batch.reference())


def test_bad_arguments_are_refused(fused) -> None:
    batch = Batch(torch.bfloat16, 1, 2, 64, 16, [40], [(0, 0, 40)], seed=1)
    bad_lens = batch.seq_lens.clone()
    bad_lens[3] = 10_000
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.hpu_serve.prefill_attention(batch.query, batch.keys_t, batch.v,
                                              batch.block_tables, bad_lens, batch.scale)
    with pytest.raises(RuntimeError, match="query's dtype"):
        torch.ops.hpu_serve.prefill_attention(batch.query.float(), batch.keys_t, batch.v,
                                              batch.block_tables, batch.seq_lens, batch.scale)


def test_fake_kernel_gives_the_shape(fused) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = Batch(torch.bfloat16, 1, 2, 64, 16, [40], [(0, 0, 40)], seed=2)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (batch.query, batch.keys_t, batch.v,
                                              batch.block_tables, batch.seq_lens)]
        out = torch.ops.hpu_serve.prefill_attention(*args, batch.scale)
    assert out.shape == batch.query.shape and out.dtype == torch.bfloat16


def test_layer_ops_send_plain_prompt_chunks_to_the_tiled_kernel(fused, monkeypatch) -> None:
    """The plain case goes to the tiled kernel; a window, a cap, sinks or a chunk keep the
    paged kernel (the tiled one serves none of them)."""
    batch = Batch(torch.bfloat16, 3, 3, 64, 16, [120], [(0, 20, 100)], seed=3)
    meta = AttentionMetadata(True, 16, torch.zeros(100, dtype=torch.long),
                             block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                             has_context=True, packed=True)
    calls: list[str] = []
    tiled, paged = fused._prefill_attention, fused._attention
    monkeypatch.setattr(fused, "_prefill_attention",
                        lambda *a: calls.append("tiled") or tiled(*a))
    monkeypatch.setattr(fused, "_attention",
                        lambda *a, **k: calls.append("paged") or paged(*a, **k))
    kv = (batch.keys_t, batch.v)
    out = fused.prompt_attention(batch.query, None, None, kv, meta, 1, batch.scale)
    assert calls == ["tiled"]
    assert_close(torch.bfloat16, out, batch.reference())
    for kwargs in ({"window": 50}, {"softcap": 30.0}, {"chunk": 64},
                   {"sinks": torch.zeros(9)}):
        calls.clear()
        fused.prompt_attention(batch.query, None, None, kv, meta, 1, batch.scale, **kwargs)
        assert calls == ["paged"], kwargs
