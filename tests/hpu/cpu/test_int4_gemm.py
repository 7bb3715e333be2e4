"""torch.ops.hpu_serve.int4_linear (csrc/int4_gemm.cpp): the dequantized weight times x
within fp32 rounding (against a float64 reference), for GGUF's Q4_0 / Q4_1 / Q4_K blocks as
the loader splits them; a row's bits do not depend on how many rows share the call (the
property that keeps greedy text with speculation equal to plain decoding); the layer runs it
for small batches; the op traces as one opaque call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.int4_pack import TILE, int4_kernel_available, int4_linear, pack_int4
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.linear import SmallBatchInt4Linear
from server.models.gguf_quants import split_blocks


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    assert int4_kernel_available()


def random_weight(n: int, k: int, group: int, with_zero: bool, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.05
    zero = ((torch.rand(n, k // group, generator=gen) - 0.5) * 0.1 if with_zero
            else torch.zeros(n, k // group))
    return codes, scale, zero


def dequantized(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                magnitude: bool = False) -> torch.Tensor:
    """``(codes - 8) * scale + zero`` in float64, or (``magnitude``) the size of its terms,
    ``|codes - 8| * |scale| + |zero|``, which bounds the kernel's rounding."""
    group = codes.shape[1] // scale.shape[1]
    q, s, z = (codes.double() - 8, scale.double().repeat_interleave(group, 1),
               zero.double().repeat_interleave(group, 1))
    return q.abs() * s.abs() + z.abs() if magnitude else q * s + z


def assert_matches_reference(x: torch.Tensor, w: torch.Tensor, terms: torch.Tensor,
                             got: torch.Tensor) -> None:
    """``got`` (bf16) is ``x @ w^T`` (float64) up to fp32 accumulation and one rounding to
    bf16: within half a bf16 ulp plus the worst case of its fp32 sums, a sum of group terms
    then one of 2 per group, bounded by 2K + 4 units of 2^-24 of |x| times the terms' sizes
    (``terms``: see ``dequantized``)."""
    exact = x.double() @ w.t()
    k = x.shape[-1]
    accumulated = (x.double().abs() @ terms.t()) * 2.0 ** -24 * (2 * k + 4)
    bound = (exact.abs() + accumulated) * 2.0 ** -8 + accumulated
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all()), \
        (got.double() - exact).abs().div(bound).max()


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 17])
@pytest.mark.parametrize(("n", "k", "group"), [(48, 128, 32), (960, 576, 32), (40, 256, 64),
                                               (17, 64, 16), (130, 512, 128), (16, 8, 4)])
@pytest.mark.parametrize("with_zero", [True, False], ids=["zero", "no-zero"])
def test_matches_dequantize_then_matmul(rows: int, n: int, k: int, group: int,
                                        with_zero: bool) -> None:
    codes, scale, zero = random_weight(n, k, group, with_zero)
    packed = pack_int4(codes, scale, zero)
    assert packed.weight.shape[0] == -(-n // TILE)
    assert packed.weight.shape[2] == group * TILE // 2 + (2 if with_zero else 1) * TILE * 4
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert_matches_reference(x, dequantized(codes, scale, zero),
                             dequantized(codes, scale, zero, magnitude=True),
                             int4_linear(x, packed))


def gguf_rows(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random but valid raw GGUF rows: finite fp16 scales, any code bytes."""
    rng = np.random.default_rng(seed)
    width = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[type_name]
    block = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}[type_name]
    raw = rng.integers(0, 256, (n, k // block, width), dtype=np.uint8)
    halves = 1 if type_name == "Q4_0" else 2
    scales = (rng.standard_normal((n, k // block, halves)) * 0.01).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // block, 2 * halves)
    return raw.reshape(n, -1)


def llama_cpp_dequantize(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """llama.cpp's dequantize_row_q4_0 / q4_1 written out in float64 (Q4_K: via the split)."""
    n = raw.shape[0]
    if type_name == "Q4_K":
        codes, scale, zero = split_blocks(raw, type_name)
        return dequantized(*(torch.from_numpy(a) for a in (codes, scale, zero)))
    width = 18 if type_name == "Q4_0" else 20
    blocks = raw.reshape(n, -1, width)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = blocks[..., width - 16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)
    if type_name == "Q4_0":
        w = (q - 8) * d[..., None]
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        w = q * d[..., None] + m[..., None]
    return torch.from_numpy(w.reshape(n, -1))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_gguf_blocks_as_the_loader_splits_them(type_name: str, rows: int) -> None:
    n, k = 80, 512
    raw = gguf_rows(type_name, n, k, seed=rows)
    codes, scale, zero = (torch.from_numpy(a) for a in split_blocks(raw, type_name))
    packed = pack_int4(codes, scale, zero)
    # Q4_0 has no zero term: its blocks carry scales only
    assert (packed.weight.shape[2] == 32 * 8 + 64) == (type_name == "Q4_0")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_matches_reference(x, llama_cpp_dequantize(raw, type_name),
                             dequantized(codes, scale, zero, magnitude=True),
                             int4_linear(x, packed))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_zero", [True, False], ids=["zero", "no-zero"])
def test_a_rows_bits_do_not_depend_on_the_row_count(with_zero: bool,
                                                    out_dtype: torch.dtype) -> None:
    """Checked on the fp32 accumulators too: rounding to bf16 hides most fp32 differences
    (an order of summation that changed with the row count would pass in bf16 alone)."""
    codes, scale, zero = random_weight(200, 576, 32, with_zero, seed=3)
    packed = pack_int4(codes, scale, zero)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([int4_linear(x[i:i + 1], packed, out_dtype) for i in range(17)])
    assert alone.dtype == out_dtype
    for rows in range(1, 18):
        assert torch.equal(int4_linear(x[:rows], packed, out_dtype), alone[:rows]), rows
    # the other rows' values do not leak in either
    other = x.clone()
    other[1:] = torch.randn(16, 576).bfloat16() * 100
    assert torch.equal(int4_linear(other, packed, out_dtype)[0], alone[0])
    # nor does the thread count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(int4_linear(x, packed, out_dtype), alone)
    finally:
        torch.set_num_threads(threads)
    if out_dtype == torch.float32:  # the bf16 output is these accumulators, rounded once
        assert torch.equal(int4_linear(x, packed), alone.bfloat16())


def test_shapes_and_bad_input() -> None:
    codes, scale, zero = random_weight(24, 64, 32, True)
    packed = pack_int4(codes, scale, zero)
    x = torch.randn(2, 3, 64).bfloat16()
    assert int4_linear(x, packed).shape == (2, 3, 24)
    assert int4_linear(x[:0], packed).shape == (0, 3, 24)
    with pytest.raises(RuntimeError, match="bfloat16"):
        int4_linear(x.float(), packed)
    with pytest.raises(RuntimeError, match="out_dtype"):
        int4_linear(x, packed, torch.float16)
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.hpu_serve.int4_linear(x, packed.weight, 6, 24)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.hpu_serve.int4_linear(x, packed.weight, 32, 40)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int4(codes[:, :60], scale[:, :2], zero[:, :2])


def test_traces_as_one_opaque_op() -> None:
    """A meta kernel gives fake tensors the shape: torch.compile sees one call."""
    codes, scale, zero = random_weight(24, 64, 32, True)
    packed = pack_int4(codes, scale, zero)
    x = torch.randn(3, 64).bfloat16()
    meta = torch.ops.hpu_serve.int4_linear(x.to("meta"), packed.weight.to("meta"), 32, 24)
    assert meta.device.type == "meta" and meta.shape == (3, 24) and meta.dtype == x.dtype
    meta = torch.ops.hpu_serve.int4_linear(x.to("meta"), packed.weight.to("meta"), 32, 24,
                                           torch.float32)
    assert meta.dtype == torch.float32
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t, w: torch.ops.hpu_serve.int4_linear(t, w, 32, 24), tracing_mode="fake")(
            x, packed.weight)
    calls = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert calls == [torch.ops.hpu_serve.int4_linear.default]


class _Codes:
    def __init__(self, n: int, k: int, group: int) -> None:
        self.codes, self.scale, self.zero = random_weight(n, k, group, True, seed=5)


class _NoDense(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the dense weights ran")


def test_the_layer_runs_the_kernel_up_to_max_rows() -> None:
    weight = _Codes(64, 128, 32)
    layer = SmallBatchInt4Linear(_NoDense(128, 64, bias=False), weight, 32, max_rows=9,
                                 dtype=torch.bfloat16, kernel=True)
    assert layer.packed is not None and "hpu_serve" in repr(layer)
    x = torch.randn(1, 9, 128).bfloat16()
    got = layer(x)
    assert got.shape == (1, 9, 64)
    assert torch.equal(got, torch.cat([layer(x[:, j:j + 1]) for j in range(9)], dim=1))
    parts = (weight.codes, weight.scale, weight.zero)
    assert_matches_reference(x[0], dequantized(*parts), dequantized(*parts, magnitude=True),
                             got[0])
    with pytest.raises(AssertionError, match="dense"):
        layer(torch.randn(10, 128).bfloat16())


@pytest.mark.slow
def test_speculation_on_the_q4_gguf_keeps_greedy_text_in_a_batch(smollm2_gguf) -> None:
    """The embedded Q4_1 model serves a batch's verify steps (3 sequences x 4 rows) from the
    kernel as it serves plain decode's (3 rows): every greedy token is the plain engine's,
    batched and one request at a time."""
    from server import LLM, SamplingParams

    folder, _ = smollm2_gguf
    common = {"max_num_seqs": 4, "max_model_len": 512}
    plain = LLM(folder, **common)
    spec = LLM(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_min": 2, "prompt_lookup_max": 4},
               **common)
    layers = [m for m in spec.engine.runner.model.modules()
              if isinstance(m, SmallBatchInt4Linear)]
    assert layers and all(m.packed is not None and m.max_rows >= 12 for m in layers)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    texts = ["Copy this list exactly: apples, pears, plums, cherries, grapes, lemons.",
             "Repeat word for word: the quick brown fox jumps over the lazy dog.",
             "Write the numbers from one to twelve in words, separated by commas."]
    prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": t}],
                                           add_generation_prompt=True) for t in texts]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert [spec.generate([p], params)[0].outputs[0].token_ids for p in prompts] == want
    assert spec.engine.stats().spec_num_accepted_tokens > 0
