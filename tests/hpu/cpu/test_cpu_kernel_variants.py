"""The fused CPU kernels' attention variants against a float64 dense reference (sliding
windows, attention chunks, soft-capped scores, attention sinks, heads of 96 and 256, fp8 e4m3
KV caches), their rotary + cache
write against the PyTorch ops byte for byte (partial rotary, fp8 stores), Gemma's norms and
GeGLU, and the engine serving every such family on the kernels with transformers' greedy
tokens."""

from __future__ import annotations

import random

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.layer_ops import FusedCpuLayerOps
from server.hpu.layer_ops import TorchLayerOps

DTYPES = [torch.bfloat16, torch.float32]
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fused() -> FusedCpuLayerOps:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    return FusedCpuLayerOps()


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int | None, softcap: float | None,
                    sinks: torch.Tensor | None = None, chunk: int | None = None
                    ) -> torch.Tensor:
    """q [Hq, D], the last of the sequence's k / v [T, Hkv, D], in float64: it sees the
    last ``window`` keys (transformers' rule) of its own ``chunk`` of positions, scores
    capped as cap * tanh(s / cap); each head's sink logit (gpt-oss) an extra softmax column,
    dropped after."""
    if chunk is not None:
        start = (k.shape[0] - 1) // chunk * chunk
        k, v = k[start:], v[start:]
    if window is not None:
        k, v = k[-window:], v[-window:]
    groups = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(groups, 1).transpose(0, 1)
    v = v.double().repeat_interleave(groups, 1).transpose(0, 1)
    scores = (q.double().unsqueeze(1) @ k.transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is not None:
        column = sinks.double().view(-1, 1, 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
        return (probs @ v).squeeze(1)
    return (torch.softmax(scores, -1) @ v).squeeze(1)


def random_cache(num_blocks: int, kv_heads: int, block: int, dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = (torch.randn(num_blocks + 1, kv_heads, block, dim) * 2).to(dtype).to(kv_dtype)
    return k_cache, (torch.randn_like(k_cache, dtype=torch.float32) * 2).to(kv_dtype)


# (window, softcap, fp8 cache): each variant alone, then together
VARIANTS = [(None, None, False), (5, None, False), (16, None, False), (40, None, False),
            (None, 2.0, False), (None, None, True), (21, 3.0, True)]
VARIANT_IDS = ["plain", "window5", "window16", "window40", "softcap", "fp8", "all"]


def check_rows(fused, dtype, kv_heads, groups, dim, block, row_tables, row_lens, tables_of,
               rows, window, softcap, kv_dtype, rng_seed, sinks: bool = False,
               chunk: int | None = None) -> None:
    torch.manual_seed(rng_seed)
    num_blocks = max(b for t in tables_of for b in t) + 1
    k_cache, v_cache = random_cache(num_blocks, kv_heads, block, dim, dtype, kv_dtype)
    keys_t = k_cache.transpose(2, 3).contiguous()  # the kernels' key layout
    width = max(len(t) for t in row_tables)
    meta = AttentionMetadata(
        False, block, torch.zeros(len(row_lens), dtype=torch.long),
        block_tables=torch.tensor([t + [num_blocks] * (width - len(t)) for t in row_tables],
                                  dtype=torch.int32),
        seq_lens=torch.tensor(row_lens, dtype=torch.int32))
    # queries as the model passes them: a strided view into a fused qkv row
    qkv = torch.randn(len(row_lens), (kv_heads * groups + 2 * kv_heads) * dim, dtype=dtype)
    query = qkv.view(len(row_lens), -1, dim)[:, : kv_heads * groups]
    scale = dim**-0.5
    # sinks spread from well below to well above typical scores: each head weighs its own
    sink = torch.linspace(-4.0, 6.0, kv_heads * groups) if sinks else None
    out = fused.decode_attention(query, (keys_t, v_cache), meta, scale, softcap, window,
                                 chunk=chunk, sinks=sink)
    assert out.shape == query.shape and out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for row, (seq, n) in enumerate(zip(rows, row_lens)):
        blocks = torch.tensor(tables_of[seq])
        k = k_cache[blocks].float().transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        v = v_cache[blocks].float().transpose(1, 2).reshape(-1, kv_heads, dim)[:n]
        want = dense_reference(query[row], k, v, scale, window, softcap, sink, chunk)
        torch.testing.assert_close(out[row].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (1, 4, 256, 16),  # Gemma 3 (270M, 1B)
    (2, 2, 256, 32),  # Gemma 2 2B
    (2, 1, 96, 16),  # Phi-3 mini
    (3, 3, 64, 16),  # SmolLM2
    (3, 3, 64, 128),  # SmolLM2 at the CPU's default block: 32- and 64-token score passes
    (1, 8, 128, 48),  # 8 query heads a kv head; 32-token passes that overrun a 48-token block
    (1, 2, 40, 12)])  # the generic loops: no fast path, no whole 16-token chunk
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 48, 130, 3], [130], [17, 2]],
                         ids=["rows-per-thread", "one-row", "two-rows"])  # the two splits
def test_decode_attention_variants_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                               block, lens) -> None:
    window, softcap, fp8 = variant
    rng = random.Random(dim + len(lens))
    free = list(range(sum(-(-n // block) for n in lens) + 5))
    rng.shuffle(free)  # scattered tables, as after churn
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    check_rows(fused, dtype, kv_heads, groups, dim, block, tables, lens, tables,
               list(range(len(lens))), window, softcap, FP8 if fp8 else dtype, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (1, 4, 256, 16), (2, 1, 96, 16), (2, 2, 64, 32), (1, 6, 64, 16), (1, 2, 40, 12)])
def test_prompt_rows_variants_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                          block) -> None:
    """Packed prompt chunks (four consecutive rows of one sequence per pass): a window
    starts at a different slot for each of the four rows, sometimes in different blocks,
    and beside them one-token rows of other sequences."""
    window, softcap, fp8 = variant
    rng = random.Random(block + groups)
    chunks = [(0, 37), (40, 1), (16, 16), (5, 3), (100, 30), (7, 1), (61, 9)]
    lens_of = [c + n for c, n in chunks]
    free = list(range(sum(-(-n // block) for n in lens_of) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens_of]
    rows, row_lens, row_tables = [], [], []
    for seq, (ctx, n) in enumerate(chunks):
        for i in range(n):
            rows.append(seq)
            row_lens.append(ctx + i + 1)
            row_tables.append(tables[seq])
    check_rows(fused, dtype, kv_heads, groups, dim, block, row_tables, row_lens, tables,
               rows, window, softcap, FP8 if fp8 else dtype, groups)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5], ids=["plain", "window5"])
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (3, 3, 64, 128), (1, 4, 256, 16), (2, 1, 96, 16)])
def test_a_verify_steps_rows_are_a_plain_decodes_bits(fused, dtype, window, kv_heads, groups,
                                                      dim, block) -> None:
    """Speculative decoding verifies k + 1 consecutive tokens of a sequence in one call;
    each row must come out as the one-row decode of that token would, bit for bit, or greedy
    text with speculation drifts from greedy text without it."""
    torch.manual_seed(dim)
    ctx, k1, seqs = 150, 5, 3
    per = -(-(ctx + k1) // block)
    k_cache, v_cache = random_cache(seqs * per, kv_heads, block, dim, dtype, dtype)
    keys_t = k_cache.transpose(2, 3).contiguous()
    tables = torch.randperm(seqs * per, dtype=torch.int32).view(seqs, per)
    query = torch.randn(seqs * k1, kv_heads * groups, dim, dtype=dtype)
    lens = torch.tensor([ctx + i + 1 for _ in range(seqs) for i in range(k1)],
                        dtype=torch.int32)
    rows_tables = tables.repeat_interleave(k1, 0).contiguous()

    def attend(rows: slice) -> torch.Tensor:
        meta = AttentionMetadata(False, block, torch.zeros(len(lens[rows]), dtype=torch.long),
                                 block_tables=rows_tables[rows].contiguous(),
                                 seq_lens=lens[rows].contiguous())
        return fused.decode_attention(query[rows], (keys_t, v_cache), meta, dim**-0.5, None,
                                      window)

    together = attend(slice(None))
    for row in range(len(lens)):
        assert torch.equal(together[row], attend(slice(row, row + 1))[0]), row


# gpt-oss: sinks alone, with its 128-token-style window, and with an fp8 cache
SINK_VARIANTS = [(None, False), (5, False), (40, False), (None, True), (21, True)]
SINK_IDS = ["sinks", "sinks-window5", "sinks-window40", "sinks-fp8", "sinks-window-fp8"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", SINK_VARIANTS, ids=SINK_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (2, 4, 64, 16),  # gpt-oss's head size, 8 query heads per kv head
    (2, 2, 64, 32),
    (1, 2, 40, 12)])  # the generic loops
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 48, 130, 3], [130]],
                         ids=["rows-per-thread", "one-row"])
def test_decode_attention_sinks_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                            block, lens) -> None:
    window, fp8 = variant
    rng = random.Random(dim + len(lens))
    free = list(range(sum(-(-n // block) for n in lens) + 5))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    check_rows(fused, dtype, kv_heads, groups, dim, block, tables, lens, tables,
               list(range(len(lens))), window, None, FP8 if fp8 else dtype, dim, sinks=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", SINK_VARIANTS, ids=SINK_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (2, 4, 64, 16), (1, 2, 64, 32), (1, 2, 40, 12)])
def test_prompt_rows_sinks_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                       block) -> None:
    """Packed prompt chunks (the four-rows-at-a-time path, lone rows beside them)."""
    window, fp8 = variant
    rng = random.Random(block + groups)
    chunks = [(0, 37), (40, 1), (16, 16), (5, 3), (100, 30), (7, 1)]
    lens_of = [c + n for c, n in chunks]
    free = list(range(sum(-(-n // block) for n in lens_of) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens_of]
    rows, row_lens, row_tables = [], [], []
    for seq, (ctx, n) in enumerate(chunks):
        for i in range(n):
            rows.append(seq)
            row_lens.append(ctx + i + 1)
            row_tables.append(tables[seq])
    check_rows(fused, dtype, kv_heads, groups, dim, block, row_tables, row_lens, tables,
               rows, window, None, FP8 if fp8 else dtype, groups, sinks=True)


# (chunk, window, softcap, fp8 cache): Llama 4's chunks, shorter and longer than a block,
# alone and with the other variants
CHUNKED = [(8, None, None, False), (32, None, None, False), (24, 5, None, False),
           (12, 40, 2.0, True)]
CHUNKED_IDS = ["chunk8", "chunk32", "chunk24-window5", "chunk12-all"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", CHUNKED, ids=CHUNKED_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (2, 2, 64, 16), (1, 4, 128, 32), (1, 2, 40, 12)])
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 48, 130, 3], [130]],
                         ids=["rows-per-thread", "one-row"])
def test_decode_attention_chunks_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                             block, lens) -> None:
    chunk, window, softcap, fp8 = variant
    rng = random.Random(dim + len(lens))
    free = list(range(sum(-(-n // block) for n in lens) + 5))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens]
    check_rows(fused, dtype, kv_heads, groups, dim, block, tables, lens, tables,
               list(range(len(lens))), window, softcap, FP8 if fp8 else dtype, dim, chunk=chunk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", CHUNKED, ids=CHUNKED_IDS)
@pytest.mark.parametrize("kv_heads, groups, dim, block", [
    (2, 2, 64, 16), (1, 4, 128, 32), (1, 2, 40, 12)])
def test_prompt_rows_chunks_match_dense(fused, dtype, variant, kv_heads, groups, dim,
                                        block) -> None:
    """Packed prompt chunks, four rows per pass: a chunk boundary falls between two of the
    four rows (a later row's first visible key in a later block than the first row's)."""
    chunk, window, softcap, fp8 = variant
    rng = random.Random(block + groups)
    chunks = [(0, 37), (40, 1), (16, 16), (5, 3), (100, 30), (7, 1), (61, 9)]
    lens_of = [c + n for c, n in chunks]
    free = list(range(sum(-(-n // block) for n in lens_of) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block))] for n in lens_of]
    rows, row_lens, row_tables = [], [], []
    for seq, (ctx, n) in enumerate(chunks):
        for i in range(n):
            rows.append(seq)
            row_lens.append(ctx + i + 1)
            row_tables.append(tables[seq])
    check_rows(fused, dtype, kv_heads, groups, dim, block, row_tables, row_lens, tables,
               rows, window, softcap, FP8 if fp8 else dtype, groups, chunk=chunk)


def test_chunk_changes_the_kernel_output_like_the_torch_path(fused) -> None:
    """A chunk is no no-op on these inputs (so a kernel ignoring it fails the references
    above), and the kernel agrees with the flat PyTorch decode path's chunk mask."""
    from server.hpu.attention import flat_paged_attention

    block, dim, n, chunk = 16, 64, 45, 8
    k_cache, v_cache = random_cache(3, 1, block, dim, torch.float32, torch.float32)
    meta = AttentionMetadata(False, block, torch.zeros(1, dtype=torch.long),
                             block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32))
    query = torch.randn(1, 2, dim) * 3
    cache = (k_cache.transpose(2, 3).contiguous(), v_cache)
    plain = fused.decode_attention(query, cache, meta, dim**-0.5)
    chunked = fused.decode_attention(query, cache, meta, dim**-0.5, chunk=chunk)
    assert (chunked - plain).abs().max() > 1e-2
    # the flat layout of the same row: blocks 0-2, the query at position n - 1
    usage = torch.tensor([block, block, (n - 1) % block + 1])
    flat = AttentionMetadata(
        False, block, torch.zeros(1, dtype=torch.long),
        block_list=torch.tensor([0, 1, 2]), block_groups=torch.zeros(3, dtype=torch.long),
        block_mapping=torch.ones(3, 1),
        block_bias=torch.where(torch.arange(block) < usage.view(-1, 1), 0.0, -1e30),
        block_start=torch.arange(3) * block - (n - 1))
    torch_out = flat_paged_attention(query, k_cache, v_cache, flat, dim**-0.5, chunk=chunk)
    torch.testing.assert_close(chunked, torch_out, atol=1e-5, rtol=1e-5)


def test_window_and_softcap_change_the_kernel_output(fused) -> None:
    """The variants are not no-ops on these inputs: plain attention misses the references
    above (so a kernel ignoring its window or cap fails them)."""
    block, dim, n = 16, 64, 48
    k_cache, v_cache = random_cache(3, 1, block, dim, torch.float32, torch.float32)
    meta = AttentionMetadata(False, block, torch.zeros(1, dtype=torch.long),
                             block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32))
    query = torch.randn(1, 2, dim) * 3
    cache = (k_cache.transpose(2, 3).contiguous(), v_cache)
    plain = fused.decode_attention(query, cache, meta, dim**-0.5)
    for softcap, window in ((None, 5), (1.0, None)):
        other = fused.decode_attention(query, cache, meta, dim**-0.5, softcap, window)
        assert (other - plain).abs().max() > 1e-2
    sinks = fused.decode_attention(query, cache, meta, dim**-0.5,
                                   sinks=torch.tensor([12.0, 20.0]))  # near the top scores
    assert (sinks - plain).abs().max() > 1e-2


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_fp8", [False, True], ids=["model-dtype-cache", "fp8-cache"])
@pytest.mark.parametrize("tokens, heads, kv_heads, dim, rotary_dim", [
    (7, 4, 2, 16, 8), (3, 6, 2, 96, 72), (5, 4, 1, 256, 256), (12, 8, 8, 128, 128)])
def test_rotary_and_cache_write_match_torch_byte_for_byte(fused, dtype, kv_fp8, tokens, heads,
                                                          kv_heads, dim, rotary_dim) -> None:
    """Partial rotary (Phi-3/4) and fp8 stores: the kernel leaves the bytes
    ``key.to(torch.float8_e4m3fn)`` stores, saturation past e4m3's +-448 and subnormals
    included."""
    torch.manual_seed(tokens + dim)
    ref = TorchLayerOps()
    block, num_blocks = 8, 10
    kv_dtype = FP8 if kv_fp8 else dtype
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype) * 4
    qkv[0, -4:] = torch.tensor([500.0, -1e-3, 3e-3, 448.0])  # a value's range edges
    angles = torch.randn(tokens, 1, rotary_dim // 2) * 10
    rope = (torch.cat((angles, angles), -1).cos().to(dtype),
            torch.cat((angles, angles), -1).sin().to(dtype))
    slots = torch.randperm(num_blocks * block)[:tokens]
    meta = AttentionMetadata(True, block, slots)
    caches, results = {}, {}
    for name, ops in (("torch", ref), ("fused", fused)):
        cache = ops.kv_cache_views(
            [(torch.zeros(num_blocks, kv_heads, block, dim, dtype=kv_dtype),
              torch.zeros(num_blocks, kv_heads, block, dim, dtype=kv_dtype))])
        results[name] = ops.rotary_write_kv(qkv.clone(), rope, cache[0], meta, heads, kv_heads)
        caches[name] = cache[0]
    for got, want in zip(results["fused"], results["torch"]):
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    fused_keys, fused_values = caches["fused"]
    torch_keys, torch_values = caches["torch"]
    if kv_fp8 or dtype == torch.bfloat16:  # fp8: the same bytes
        assert torch.equal(fp8_bytes(fused_keys.transpose(2, 3).contiguous()),
                           fp8_bytes(torch_keys))
        assert torch.equal(fp8_bytes(fused_values), fp8_bytes(torch_values))
    else:
        torch.testing.assert_close(fused_keys.transpose(2, 3), torch_keys, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(fused_values, torch_values)
    assert fused_values.float().abs().nansum() > 0  # the tokens' slots were written
    if kv_fp8:  # 500 is past e4m3's range: saturated, as torch's cast does
        assert (fused_values.float() == 448).sum() >= 2
    if rotary_dim < dim:  # the unrotated tail passes through
        q = results["fused"][0]
        source = qkv.view(tokens, -1, dim)[:, :heads, rotary_dim:]
        assert torch.equal(q[..., rotary_dim:], source)


@pytest.mark.parametrize("rows", [1, 6])
def test_gemma_norms_and_geglu_match_torch(fused, rows: int) -> None:
    """bf16 activations with Gemma's float32 norm weights (scaled before the one rounding),
    and GeGLU (tanh GELU of the gate times up)."""
    torch.manual_seed(rows)
    ref = TorchLayerOps()
    x = torch.randn(rows, 640, dtype=torch.bfloat16) * 3
    residual = torch.randn_like(x)
    weight = 1 + torch.randn(640) * 0.3  # float32, as keep_norms_in_float leaves it
    assert torch.equal(fused.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    want_norm, want_residual = ref.add_rms_norm(x, residual, weight, 1e-6)
    got_norm, got_residual = fused.add_rms_norm(x, residual.clone(), weight, 1e-6)
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(got_norm, want_norm)
    for dtype in DTYPES:
        gate_up = (torch.randn(rows, 2 * 2048) * 4).to(dtype)
        gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -6.0, 12.0])
        got, want = fused.gelu_tanh_and_mul(gate_up), ref.gelu_tanh_and_mul(gate_up)
        assert got.dtype == dtype
        # tanh differs from PyTorch's in the last fp32 bits: at most one bf16 rounding
        torch.testing.assert_close(got, want, rtol=8e-3 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)


def test_can_serve_every_variant_but_uncompiled_cache_dtypes(fused) -> None:
    for kv_dtype in (torch.bfloat16, torch.float32, FP8):
        assert fused.can_serve(kv_dtype, 50.0, 512, partial_rotary=True)
    assert not fused.can_serve(torch.float16, None)
    assert not fused.can_serve(torch.float8_e5m2, None)
