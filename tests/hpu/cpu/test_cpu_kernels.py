"""The fused CPU kernels against the PyTorch layer ops (bit for bit in bf16) and a float64
dense attention reference, plus their bounds checks and how the engine picks them."""

from __future__ import annotations

import random

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.layer_ops import FusedCpuLayerOps
from server.hpu.layer_ops import TorchLayerOps
from server.hpu.types import DecodeLayout

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def fused() -> FusedCpuLayerOps:
    # CI machines have a compiler: failing to build is a failure, not a skip.
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    return FusedCpuLayerOps()


def assert_same(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
    if dtype == torch.bfloat16:  # rounded where PyTorch rounds: identical values
        assert torch.equal(actual, expected)
    else:  # fp32: FMA contraction may differ in the last bit
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_norms_and_silu_match_torch(fused, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    ref = TorchLayerOps()
    x = torch.randn(rows, 1, 200, dtype=dtype) * 3
    residual = torch.randn_like(x)
    weight = torch.randn(200, dtype=dtype)
    assert_same(dtype, fused.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    want_norm, want_residual = ref.add_rms_norm(x, residual, weight, 1e-6)
    got_norm, got_residual = fused.add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert_same(dtype, got_residual, want_residual)
    assert_same(dtype, got_norm, want_norm)
    gate_up = torch.randn(rows, 2 * 96, dtype=dtype) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends
    assert_same(dtype, fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 9, 3, 64), (7, 4, 2, 16),
                                                          (12, 8, 8, 128)])
def test_rotary_and_cache_write_match_torch(fused, dtype, tokens, heads, kv_heads, dim) -> None:
    torch.manual_seed(tokens)
    ref = TorchLayerOps()
    block, num_blocks = 8, 10
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.randn(tokens, 1, dim // 2) * 10
    rope = (torch.cat((angles, angles), -1).cos().to(dtype),
            torch.cat((angles, angles), -1).sin().to(dtype))
    slots = torch.randperm(num_blocks * block)[:tokens]
    meta = AttentionMetadata(True, block, slots)
    caches = {}
    results = {}
    for name, ops in (("torch", ref), ("fused", fused)):
        cache = ops.kv_cache_views([(torch.zeros(num_blocks, kv_heads, block, dim, dtype=dtype),
                                     torch.zeros(num_blocks, kv_heads, block, dim, dtype=dtype))])
        results[name] = ops.rotary_write_kv(qkv.clone(), rope, cache[0], meta, heads, kv_heads)
        caches[name] = cache[0]
    for got, want in zip(results["fused"], results["torch"]):
        assert got.shape == want.shape
        assert_same(dtype, got, want)
    fused_keys, fused_values = caches["fused"]
    assert fused_keys.shape == (num_blocks, kv_heads, dim, block)  # keys transposed per block
    assert_same(dtype, fused_keys.transpose(2, 3), caches["torch"][0])
    assert_same(dtype, fused_values, caches["torch"][1])
    assert fused_values.abs().sum() > 0  # the tokens' slots were written


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [Hq, D] against one sequence's k/v [T, Hkv, D], in float64."""
    groups = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(groups, 1).transpose(0, 1)
    v = v.double().repeat_interleave(groups, 1).transpose(0, 1)
    probs = torch.softmax((q.double().unsqueeze(1) @ k.transpose(1, 2)) * scale, -1)
    return (probs @ v).squeeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (3, 3, 64, 16), (2, 4, 128, 32), (1, 2, 40, 12)])  # 12: a block that is no whole chunk
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 48, 130, 3], [130], [17, 2]],
                         ids=["rows-per-thread", "one-row", "two-rows"])  # the two splits
def test_decode_attention_matches_dense(fused, dtype, kv_heads, groups, dim, block,
                                        lens) -> None:
    rng = random.Random(dim)
    torch.manual_seed(dim)
    num_blocks = sum(-(-n // block) for n in lens) + 5
    k_cache = torch.randn(num_blocks + 1, kv_heads, block, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    keys_t = k_cache.transpose(2, 3).contiguous()  # the kernels' key layout
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered tables, as after churn
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        False, block, torch.zeros(len(lens), dtype=torch.long),
        block_tables=torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables],
                                  dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32))
    # queries as the model passes them: a strided view into a fused qkv row
    qkv = torch.randn(len(lens), (kv_heads * groups + 2 * kv_heads) * dim, dtype=dtype)
    query = qkv.view(len(lens), -1, dim)[:, : kv_heads * groups]
    scale = dim**-0.5
    out = fused.decode_attention(query, (keys_t, v_cache), meta, scale)
    assert out.shape == query.shape
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for row, (n, table) in enumerate(zip(lens, tables)):
        blocks = torch.tensor(table)
        k = k_cache[blocks].transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        v = v_cache[blocks].transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        want = dense_reference(query[row], k, v, scale)
        torch.testing.assert_close(out[row].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (3, 3, 64, 16), (2, 4, 128, 32), (1, 1, 64, 16), (2, 2, 64, 32), (1, 6, 64, 16)])
def test_prompt_rows_of_one_sequence_match_dense(fused, dtype, kv_heads, groups, dim,
                                                 block) -> None:
    """Packed prompt chunks: consecutive rows of one sequence (same table, one more token
    each) run four at a time against each block; chunks start after a context, end on and
    across block boundaries, and sit beside one-token (decode) rows of other sequences."""
    rng = random.Random(block + groups)
    torch.manual_seed(groups)
    # (tokens before the chunk, chunk length) per sequence
    chunks = [(0, 37), (40, 1), (16, 16), (5, 3), (100, 30), (7, 1)]
    lens_of = [c + n for c, n in chunks]
    num_blocks = sum(-(-n // block) for n in lens_of) + 3
    k_cache = torch.randn(num_blocks + 1, kv_heads, block, dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    keys_t = k_cache.transpose(2, 3).contiguous()
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens_of]
    width = max(len(t) for t in tables)
    rows, row_lens, row_tables = [], [], []
    for seq, (ctx, n) in enumerate(chunks):
        for i in range(n):
            rows.append(seq)
            row_lens.append(ctx + i + 1)
            row_tables.append(tables[seq] + [num_blocks] * (width - len(tables[seq])))
    meta = AttentionMetadata(
        True, block, torch.zeros(len(rows), dtype=torch.long),
        block_tables=torch.tensor(row_tables, dtype=torch.int32),
        seq_lens=torch.tensor(row_lens, dtype=torch.int32))
    qkv = torch.randn(len(rows), (kv_heads * groups + 2 * kv_heads) * dim, dtype=dtype)
    query = qkv.view(len(rows), -1, dim)[:, : kv_heads * groups]
    scale = dim**-0.5
    out = fused.decode_attention(query, (keys_t, v_cache), meta, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for row, (seq, n) in enumerate(zip(rows, row_lens)):
        blocks = torch.tensor(tables[seq])
        k = k_cache[blocks].transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        v = v_cache[blocks].transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        want = dense_reference(query[row], k, v, scale)
        torch.testing.assert_close(out[row].double(), want, atol=tol, rtol=tol)


def test_kernels_refuse_out_of_range_indices(fused) -> None:
    block, dim = 4, 8
    cache = (torch.zeros(3, 1, dim, block), torch.zeros(3, 1, block, dim))
    query = torch.randn(1, 2, dim)
    tables = torch.tensor([[0, 7]], dtype=torch.int32)
    bad_block = AttentionMetadata(False, block, torch.zeros(1, dtype=torch.long),
                                  block_tables=tables, seq_lens=torch.tensor([6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of the cache"):
        fused.decode_attention(query, cache, bad_block, 1.0)
    too_long = AttentionMetadata(False, block, torch.zeros(1, dtype=torch.long),
                                 block_tables=tables[:, :1], seq_lens=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        fused.decode_attention(query, cache, too_long, 1.0)
    qkv = torch.randn(1, 4 * dim)
    rope = (torch.ones(1, 1, dim), torch.zeros(1, 1, dim))
    with pytest.raises(RuntimeError, match="out of the cache"):
        fused.rotary_write_kv(qkv, rope, cache, AttentionMetadata(
            True, block, torch.tensor([3 * block])), 2, 1)


def test_engine_uses_kernels_on_cpu_unless_disabled(fused, tiny_model) -> None:
    from server import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for flag in ("1", "0"):
        llm = LLM(tiny_model[0], dtype="float32", block_size=16,
                  environ={"HPU_SERVE_CPU_KERNELS": flag})
        runner = llm.engine.runner
        assert runner.inputs.decode_layout is (DecodeLayout.BLOCK_TABLES if flag == "1"
                                               else DecodeLayout.FLAT)
        assert runner.model.layers[0].self_attn.ops.name == ("fused-cpu" if flag == "1"
                                                             else "torch")
        outputs[flag] = [o.outputs[0].token_ids for o in llm.generate(
            ["the quick brown fox", "paged attention"], params)]
    assert outputs["1"] == outputs["0"]


def test_float16_on_cpu_keeps_pytorch_ops(fused, tiny_model) -> None:
    from server import LLM, SamplingParams

    llm = LLM(tiny_model[0], dtype="float16", block_size=16)
    assert llm.engine.runner.model.layers[0].mlp.ops.name == "torch"
    out = llm.generate(["the quick"], SamplingParams(temperature=0, max_tokens=5,
                                                     ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_attention_kernel_matches_sdpa_on_a_padded_batch(fused, dtype) -> None:
    """Prefill through the paged kernel (one row per token, causal via per-token lengths)
    against PyTorch's SDPA on the same right-padded [bs, q] batch."""
    from server.engine.core.block_manager import BlockManager
    from server.engine.core.sequence import Sequence
    from server.engine.sampling_params import SamplingParams
    from server.engine.worker.input_builder import InputBuilder

    torch.manual_seed(3)
    block, heads, kv_heads, dim = 16, 6, 2, 64
    manager = BlockManager(16, block)
    seqs = []
    for i, n in enumerate([37, 5, 16]):
        seq = Sequence(i, str(i), 0, [1] * n, SamplingParams(), 0.0)
        manager.allocate(seq)
        seqs.append(seq)
    builder = InputBuilder(block, manager.pad_block_id, torch.device("cpu"), dtype, 4096,
                           DecodeLayout.BLOCK_TABLES)
    meta = builder.prefill(seqs).meta
    tokens = len(seqs) * 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    rope = (torch.ones(tokens, 1, dim, dtype=dtype), torch.zeros(tokens, 1, dim, dtype=dtype))
    cache = fused.kv_cache_views([(torch.zeros(17, kv_heads, block, dim, dtype=dtype),
                                   torch.zeros(17, kv_heads, block, dim, dtype=dtype))])[0]
    q, k, v = fused.rotary_write_kv(qkv, rope, cache, meta, heads, kv_heads)
    got = fused.prompt_attention(q, k, v, cache, meta, len(seqs), dim**-0.5)
    want = TorchLayerOps().prompt_attention(q, k, v, cache, meta, len(seqs), dim**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for row, seq in enumerate(seqs):  # real tokens only: padding rows are never read
        real = slice(row * 37, row * 37 + seq.num_tokens)
        torch.testing.assert_close(got[real], want[real], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 16, 49152 + 7])
def test_argmax_matches_torch_including_ties_nan_and_infinities(fused, dtype, width) -> None:
    torch.manual_seed(width)
    x = torch.randn(9, width).to(dtype)
    x[1] = 0.5  # all equal: the first index
    x[2, width // 2] = float("inf")
    x[3] = float("-inf")  # nothing finite: the first index
    x[4, width - 1] = float("nan")  # NaN counts as the largest
    x[5, -1] = 1e4
    if width > 1:
        x[6, 0] = x[6, width - 1] = 1e4  # a tie across the row: the first
        x[7, width // 3] = x[7, width // 2] = float("nan")
    got = torch.ops.hpu_serve.argmax(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.argmax(dim=-1))


def test_a_failed_or_impossible_build_falls_back_to_pytorch_ops(tmp_path, monkeypatch,
                                                                 caplog) -> None:
    from server.hpu.cpu import kernels as cpu_kernels

    cache = tmp_path / "cache"
    cache.mkdir()
    failing = tmp_path / "c++"
    failing.write_text("#!/bin/sh\necho 'fatal error: no such header' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: str(failing))
    with caplog.at_level("WARNING"):
        assert cpu_kernels._load(cache) is False
    assert "no such header" in caplog.text
    assert not list(cache.glob("*.so"))
    assert not list(cache.glob(".build-*"))  # nothing left
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    with caplog.at_level("WARNING"):
        assert cpu_kernels._load(cache) is False
    assert "no C++ compiler" in caplog.text
