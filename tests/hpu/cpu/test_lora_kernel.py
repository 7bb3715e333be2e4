"""The fused LoRA kernel (``torch.ops.hpu_serve.lora_add_``, csrc/lora_kernels.cpp) against
the PyTorch op it replaces (server/models/lora/ops.py ``lora_dense``) and a float64 truth:
mixed slots with rows of no adapter, ranks 8 and 16 in 16-wide slots, fused qkv / gate_up
parts, widths off the 16-lane grid; in place, opaque to torch.compile, its bounds checked."""

from __future__ import annotations

import pytest
import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.kernels import load_cpu_kernels
from server.models.lora.ops import kernel_rows, lora_dense, lora_kernel, slot_mask
from server.models.lora.peft import LoRASite, SiteShape
from server.models.lora.slots import LayerLoRA

# (inputs, part widths): SmolLM2's qkv / gate_up / down, and odd sizes (tails of 16 lanes)
SITES = [(576, (576, 192, 192)), (576, (1536, 1536)), (1536, (576,)), (40, (20, 36, 9))]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    # CI machines have a compiler: failing to build is a failure, not a skip.
    assert load_cpu_kernels(writable_cache_dir() / "kernels"), \
        "the fused CPU kernels did not build (see the log)"


def make_site(inputs: int, parts: tuple[int, ...], slots: int, rank: int, ranks: list[int],
              tokens: int, dtype: torch.dtype, seed: int):
    """Random x, base output, slot stacks (slot i holds an adapter of rank ``ranks[i]``,
    the rest of its ``rank`` rows zero, as LoRASlots.load leaves them) and each row's slot
    (0: none)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(parts), slots, rank, inputs)
    bt = torch.zeros(slots, rank, sum(parts))
    for s, r in enumerate(ranks):
        a[:, s, :r] = torch.randn(len(parts), r, inputs, generator=gen) * 0.1
        bt[s, :r] = torch.randn(r, sum(parts), generator=gen) * 0.1
    x = torch.randn(tokens, inputs, generator=gen)
    y = torch.randn(tokens, sum(parts), generator=gen)
    row_slots = torch.randint(0, slots + 1, (tokens,), generator=gen)
    row_slots[-1] = slots  # one row of the last slot, and one without adapter
    if tokens > 1:
        row_slots[0] = 0
    return x.to(dtype), y.to(dtype), a.to(dtype), bt.to(dtype), row_slots


def truth(x, y, a, bt, row_slots, parts) -> torch.Tensor:
    """float64, row by row: y + x A_p^T B_p^T for each part p of the row's slot."""
    out = y.double().clone()
    for t, s in enumerate(row_slots.tolist()):
        if s == 0:
            continue
        col = 0
        for p, width in enumerate(parts):
            h = a[p, s - 1].double() @ x[t].double()
            out[t, col:col + width] += h @ bt[s - 1, :, col:col + width].double()
            col += width
    return out


@pytest.mark.parametrize("inputs,parts", SITES)
@pytest.mark.parametrize("rank,ranks", [(16, [16, 8, 16, 3]), (8, [8, 8])])
@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_float32_matches_torch_op(inputs: int, parts: tuple[int, ...], rank: int,
                                  ranks: list[int], tokens: int) -> None:
    x, y, a, bt, row_slots = make_site(inputs, parts, len(ranks), rank, ranks, tokens,
                                       torch.float32, tokens + rank)
    expected = lora_dense(x, a, bt, slot_mask(row_slots, len(ranks), x.dtype), parts, y)
    got = y.clone()
    out = lora_kernel(x, a, bt, kernel_rows(row_slots), parts, got)
    assert out.data_ptr() == got.data_ptr()  # in place
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), truth(x, y, a, bt, row_slots, parts),
                               rtol=1e-5, atol=1e-5)
    untouched = row_slots == 0
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("inputs,parts", SITES)
@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_bfloat16_within_rounding_of_torch_op(inputs: int, parts: tuple[int, ...],
                                              tokens: int) -> None:
    """bf16: both round h once and the sum once (fp32 in between), so they differ only by
    summation order: close to each other, and no further from the float64 truth."""
    x, y, a, bt, row_slots = make_site(inputs, parts, 4, 16, [16, 8, 16, 3], tokens,
                                       torch.bfloat16, tokens)
    expected = lora_dense(x, a, bt, slot_mask(row_slots, 4, x.dtype), parts, y)
    got = lora_kernel(x, a, bt, kernel_rows(row_slots), parts, y.clone())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    exact = truth(x, y, a, bt, row_slots, parts)
    ours, theirs = (got.double() - exact).abs().max(), (expected.double() - exact).abs().max()
    assert ours <= 1.5 * theirs + 1e-2, (ours, theirs)
    untouched = row_slots == 0
    assert torch.equal(got[untouched], y[untouched])


def test_rows_without_adapter_change_nothing() -> None:
    x, y, a, bt, _ = make_site(576, (576, 192, 192), 4, 16, [16] * 4, 16, torch.bfloat16, 1)
    got = y.clone()
    lora_kernel(x, a, bt, torch.full((16,), -1, dtype=torch.long), (576, 192, 192), got)
    assert torch.equal(got, y)


def test_bad_slot_index_is_refused() -> None:
    x, y, a, bt, _ = make_site(40, (20, 36, 9), 2, 8, [8, 8], 3, torch.float32, 2)
    with pytest.raises(RuntimeError, match="slot index 2 of row 1"):
        lora_kernel(x, a, bt, torch.tensor([0, 2, -1]), (20, 36, 9), y)
    with pytest.raises(RuntimeError, match="part widths must add up"):
        lora_kernel(x, a, bt, torch.tensor([0, 1, -1]), (20, 36, 8), y)


@pytest.mark.slow  # a compilation: ~30 s on a loaded 2-core host
def test_opaque_to_torch_compile() -> None:
    """One graph (fullgraph: no break at the op) serves any mix of slots, as the slot of
    each row is data."""
    parts = (576, 192, 192)
    x, y, a, bt, row_slots = make_site(576, parts, 4, 16, [16] * 4, 16, torch.float32, 3)

    def step(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return lora_kernel(x, a, bt, rows, parts, y * 1.0) + 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for rows in (kernel_rows(row_slots), kernel_rows(row_slots.flip(0)),
                 torch.full((16,), -1, dtype=torch.long)):
        expected = lora_kernel(x, a, bt, rows, parts, y.clone()) + 1.0
        torch.testing.assert_close(compiled(x, y, rows), expected)


@pytest.mark.parametrize("dtype,lora_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.float32),
                                              (torch.float32, torch.bfloat16)])
def test_layer_slots_kernel_equals_torch_path(dtype: torch.dtype,
                                              lora_dtype: torch.dtype) -> None:
    """LayerLoRA.apply with the kernel against the PyTorch op, on every site of a layer
    (a --lora-dtype other than the model's included)."""
    sites = {LoRASite.QKV: SiteShape(64, (64, 32, 32)), LoRASite.O: SiteShape(64, (64,)),
             LoRASite.GATE_UP: SiteShape(64, (96, 96)), LoRASite.DOWN: SiteShape(96, (64,))}
    torch_path = LayerLoRA(sites, 3, 16, lora_dtype, None)
    kernel_path = LayerLoRA(sites, 3, 16, lora_dtype, None, kernel=True)
    gen = torch.Generator().manual_seed(0)
    for buffer, twin in zip(torch_path.buffers(), kernel_path.buffers()):
        buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
        twin.copy_(buffer)
    row_slots = torch.tensor([0, 1, 3, 3, 2, 0, 1])
    for site, shape in sites.items():
        x = torch.randn(7, shape.inputs, generator=gen).to(dtype)
        y = torch.randn(7, shape.outputs, generator=gen).to(dtype)
        expected = torch_path.apply(site, x, y.clone(), slot_mask(row_slots, 3, lora_dtype))
        got = kernel_path.apply(site, x, y.clone(), kernel_rows(row_slots))
        tol = 2e-2 if torch.bfloat16 in (dtype, lora_dtype) else 1e-5
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        assert not torch.equal(got, y)  # the adapters do add something
