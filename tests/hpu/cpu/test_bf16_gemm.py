"""torch.ops.hpu_serve.bf16_linear (csrc/bf16_gemm.cpp): x W^T + b within fp32 rounding of
a float64 reference; a row's bits do not depend on how many rows share the call or on the
thread count (what keeps greedy text with speculation equal to plain decoding on bf16
weights); PackedLinear runs it up to its row limit and oneDNN above; one opaque op when
traced."""

from __future__ import annotations

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.bf16_pack import TILE, bf16_kernel_available, bf16_linear, pack_bf16
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.linear import PackedLinear, pack_linear_layers, packing_supported


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"
    assert bf16_kernel_available()


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(n, generator=gen)


def assert_matches_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                             got: torch.Tensor) -> None:
    """fp32 accumulation of exact products (one chain of K / 2 pair sums, then the
    bias): within (K + 4) units of 2^-24 of sum |x w| + |b|, plus half a bf16 ulp when the
    output is bf16."""
    exact = x.double() @ w.double().t()
    size = x.double().abs() @ w.double().abs().t()
    if b is not None:
        exact, size = exact + b.double(), size + b.double().abs()
    bound = size * 2.0 ** -24 * (x.shape[-1] + 4)
    if got.dtype == torch.bfloat16:
        bound = (exact.abs() + bound) * 2.0 ** -8 + bound
    assert got.shape == exact.shape
    assert bool(((got.double() - exact).abs() <= bound).all()), \
        (got.double() - exact).abs().div(bound).max()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 12, 13, 17, 33])
@pytest.mark.parametrize(("n", "k"), [(48, 128), (960, 576), (17, 64), (130, 77), (16, 2),
                                      (33, 1)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_matmul(rows: int, n: int, k: int, with_bias: bool,
                                out_dtype: torch.dtype) -> None:
    w, b = weights(n, k)
    bias = b if with_bias else None
    packed = pack_bf16(w, bias)
    assert packed.weight.shape == (-(-n // TILE), (k + 1) // 2, TILE, 2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = bf16_linear(x, packed, out_dtype)
    assert got.dtype == out_dtype
    assert_matches_reference(x, w, bias, got)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_row_count(out_dtype: torch.dtype) -> None:
    """On the fp32 accumulators too: bf16 rounding alone would hide most order changes."""
    w, b = weights(200, 576, seed=3)
    packed = pack_bf16(w, b)
    # 1-40 rows: one pass up to 12, two of up to 8 at 13-16, passes of up to 16 past them
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    alone = torch.cat([bf16_linear(x[i:i + 1], packed, out_dtype) for i in range(40)])
    for rows in range(1, 41):
        assert torch.equal(bf16_linear(x[:rows], packed, out_dtype), alone[:rows]), rows
    other = x.clone()
    other[1:] = torch.randn(39, 576).bfloat16() * 100
    assert torch.equal(bf16_linear(other, packed, out_dtype)[0], alone[0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bf16_linear(x, packed, out_dtype), alone)
    finally:
        torch.set_num_threads(threads)
    if out_dtype == torch.float32:  # the bf16 output is these accumulators, rounded once
        assert torch.equal(bf16_linear(x, packed), alone.bfloat16())


def test_shapes_and_bad_input() -> None:
    w, b = weights(24, 64)
    packed = pack_bf16(w, b)
    x = torch.randn(2, 3, 64).bfloat16()
    assert bf16_linear(x, packed).shape == (2, 3, 24)
    assert bf16_linear(x[:0], packed).shape == (0, 3, 24)
    assert bf16_linear(x.transpose(0, 1), packed).shape == (3, 2, 24)  # any strides
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_linear(x.float(), packed)
    with pytest.raises(RuntimeError, match="out_dtype"):
        bf16_linear(x, packed, torch.float16)
    with pytest.raises(RuntimeError, match="out_features"):
        torch.ops.hpu_serve.bf16_linear(x, packed.weight, None, 40)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.hpu_serve.bf16_linear(x[..., :32], packed.weight, None, 24)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.hpu_serve.bf16_linear(x, packed.weight, b[:5], 24)


def test_traces_as_one_opaque_op() -> None:
    w, _ = weights(24, 64)
    packed = pack_bf16(w)
    x = torch.randn(3, 64).bfloat16()
    meta = torch.ops.hpu_serve.bf16_linear(x.to("meta"), packed.weight.to("meta"), None, 24,
                                           torch.float32)
    assert meta.device.type == "meta" and meta.shape == (3, 24) and meta.dtype == torch.float32
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t, pw: torch.ops.hpu_serve.bf16_linear(t, pw, None, 24), tracing_mode="fake")(
            x, packed.weight)
    calls = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert calls == [torch.ops.hpu_serve.bf16_linear.default]


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="no oneDNN bf16 here")
def test_packed_linear_runs_the_kernel_up_to_its_rows_then_onednn() -> None:
    w, b = weights(64, 128, seed=7)
    linear = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(b.bfloat16())
    layer = PackedLinear(linear, small_rows=6)
    assert layer.small is not None and "bf16 kernel up to 6 rows" in repr(layer)
    x = torch.randn(2, 5, 128).bfloat16()
    few = x[:, :3]  # 6 rows
    assert torch.equal(layer(few), bf16_linear(few.reshape(6, 128), layer.small).view(2, 3, 64))
    assert_matches_reference(few.reshape(6, 128), w, linear.bias.float(),
                             layer(few).reshape(6, 64))
    # which weight runs: the kernel's copy, zeroed, answers up to 6 rows only
    layer.small = pack_bf16(torch.zeros_like(w), linear.bias)
    assert torch.equal(layer(few), linear.bias.expand(2, 3, 64))
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none",
                                                [], "")
    assert torch.equal(layer(x), onednn) and not torch.equal(onednn[:, :3], layer(few))


def test_pack_linear_layers_copies_bf16_layers_only() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 32)).bfloat16()
    if not packing_supported(torch.bfloat16):
        pytest.skip("no oneDNN bf16 here")
    assert pack_linear_layers(model, small_rows=8) == 2
    assert all(m.small is not None and m.small_rows == 8 for m in model)
    fp32 = torch.nn.Sequential(torch.nn.Linear(32, 48))
    assert pack_linear_layers(fp32, small_rows=8) == 1
    assert fp32[0].small is None
