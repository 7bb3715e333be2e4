"""torch.ops.hpu_serve.q8_linear (csrc/q8_gemm.cpp): GGUF Q8_0 codes times x within fp32
rounding of a float64 reference (llama.cpp's dequantization written out), a row's bits
independent of the rows sharing the call, and the layer that serves a GGUF's Q8_0 LM head
from it for small batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.linear import PackedLinear, SmallBatchQ8Linear
from server.hpu.cpu.q8_pack import TILE, pack_q8, q8_kernel_available, q8_linear
from server.models.gguf_quants import split_q8_0


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    assert q8_kernel_available()


def gguf_q8_rows(n: int, k: int, seed: int) -> np.ndarray:
    """Random valid raw Q8_0 rows: per block of 32, an fp16 scale then 32 int8 codes (the
    extremes -128 and 127 included)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    raw[0, 0, 2:] = 0x80  # -128 throughout one block
    raw[-1, -1, 2:] = 0x7F
    d = (rng.standard_normal((n, k // 32, 1)) * 0.01).astype(np.float16)
    raw[..., :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


def llama_cpp_dequantize(raw: np.ndarray) -> torch.Tensor:
    """dequantize_row_q8_0: ``d * q`` per block, in float64."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
    return torch.from_numpy((q * d[..., None]).reshape(n, -1))


def assert_matches_reference(x: torch.Tensor, w: torch.Tensor, got: torch.Tensor) -> None:
    """Within one bf16 rounding plus the fp32 sums' worst case: per group two sums of 32
    products, one fma and one more add per group, bounded by 2K + 8 units of 2^-24 of
    |x| @ |w|^T."""
    exact = x.double() @ w.t()
    k = x.shape[-1]
    accumulated = (x.double().abs() @ w.abs().t()) * 2.0 ** -24 * (2 * k + 8)
    bound = (exact.abs() + accumulated) * 2.0 ** -8 + accumulated
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all()), \
        (got.double() - exact).abs().div(bound).max()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize(("n", "k"), [(48, 128), (960, 576), (17, 64), (130, 32)])
def test_matches_llama_cpp_dequantize_then_matmul(rows: int, n: int, k: int) -> None:
    raw = gguf_q8_rows(n, k, seed=n + k)
    codes, scale = (torch.from_numpy(a) for a in split_q8_0(raw))
    packed = pack_q8(codes, scale)
    assert packed.weight.shape == (-(-n // TILE), k // 32, 576)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert_matches_reference(x, llama_cpp_dequantize(raw), q8_linear(x, packed))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_row_count(out_dtype: torch.dtype) -> None:
    raw = gguf_q8_rows(200, 576, seed=3)
    packed = pack_q8(*(torch.from_numpy(a) for a in split_q8_0(raw)))
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([q8_linear(x[i:i + 1], packed, out_dtype) for i in range(17)])
    for rows in range(1, 18):
        assert torch.equal(q8_linear(x[:rows], packed, out_dtype), alone[:rows]), rows
    other = x.clone()
    other[1:] = torch.randn(16, 576).bfloat16() * 100
    assert torch.equal(q8_linear(other, packed, out_dtype)[0], alone[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(q8_linear(x, packed, out_dtype), alone)
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused() -> None:
    packed = pack_q8(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2))
    with pytest.raises(RuntimeError, match="bfloat16"):
        q8_linear(torch.zeros(1, 64), packed)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8_linear(torch.zeros(1, 48, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="one scale per 32"):
        pack_q8(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 3))


def test_the_layer_serves_small_batches_from_the_codes() -> None:
    """Up to max_rows the codes answer (the dense copy is zeroed: only they can give the
    reference), past it the dense weight."""
    raw = gguf_q8_rows(96, 128, seed=7)
    codes, scale = (torch.from_numpy(a) for a in split_q8_0(raw))
    w = llama_cpp_dequantize(raw)
    zeros = torch.nn.Linear(128, 96, bias=False, dtype=torch.bfloat16)
    torch.nn.init.zeros_(zeros.weight)
    layer = SmallBatchQ8Linear(PackedLinear(zeros), codes, scale, max_rows=4)
    x = torch.randn(2, 3, 128).bfloat16()
    small = layer(x[:1])  # 3 rows
    assert small.shape == (1, 3, 96)
    assert_matches_reference(x[0], w, small[0])
    assert torch.equal(layer(x), torch.zeros(2, 3, 96, dtype=torch.bfloat16))  # 6 > 4 rows


def test_the_embedded_models_head_runs_from_its_q8_codes(smollm2_gguf) -> None:
    """SmolLM2's GGUF ties a Q8_0 head to its embeddings: the engine keeps the codes, and a
    decode row's logits are the file's dequantized head times the hidden state."""
    from server import LLM
    from server.models.gguf import read_q8_head
    from server.models.loader import _gguf_reader, resolve_model_source

    folder, name = smollm2_gguf
    llm = LLM(f"{folder}/{name}", max_num_seqs=2, max_model_len=128)
    model = llm.engine.runner.model
    head = model.lm_head
    assert isinstance(head, SmallBatchQ8Linear) and head.max_rows == 8
    source = resolve_model_source(f"{folder}/{name}")
    weight = read_q8_head(_gguf_reader(source), model.config)
    assert weight is not None and weight.codes.dtype == torch.int8
    # the codes are the dequantized embedding's exactly (the loader's fp32 dequantization)
    loaded = model.embed_tokens.weight.float()
    close = (weight.dequantize().bfloat16().float() - loaded).abs().max()
    assert float(close) == 0.0
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert_matches_reference(x, weight.dequantize().double(), head(x))
