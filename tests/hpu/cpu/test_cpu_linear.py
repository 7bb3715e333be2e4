"""oneDNN-packed linear layers: same numbers as ``F.linear``, swapped in only for eager CPU."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from server import LLM, SamplingParams
from server.hpu.cpu.linear import (
    PackedLinear,
    SmallBatchInt4Linear,
    int4_supported,
    pack_linear_layers,
    packing_supported,
)
from server.models.loader import load_model, resolve_model_source

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="this torch build has no oneDNN packing"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    if not packing_supported(dtype):
        pytest.skip(f"no oneDNN {dtype} on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    assert not any(p.dim() == 2 for p in packed.parameters())  # the dense weight is gone
    # 1 row (decode), many rows, a 3-D input and a non-contiguous one
    inputs = [torch.randn(1, 96), torch.randn(37, 96), torch.randn(2, 5, 96),
              torch.randn(96, 7).t()]
    for x in inputs:
        x = x.to(dtype)
        got, want = packed(x), nn.functional.linear(x, linear.weight, linear.bias)
        assert got.shape == want.shape
        assert got.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)  # same oneDNN kernel, only the layout changed
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_a_tied_model_keeps_its_logits(tiny_model) -> None:
    folder, _, _ = tiny_model
    loaded = load_model(resolve_model_source(folder), "bfloat16", torch.device("cpu"))
    model = loaded.model
    reference = copy.deepcopy(model)
    num_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert num_linear == 2 * model.config.num_layers * 2 + 1  # qkv, o, gate_up, down; head

    assert pack_linear_layers(model) == num_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert model.embed_tokens.weight.layout == torch.strided  # the tied embedding stays dense

    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    with torch.inference_mode():
        hidden = model.embed_tokens(ids).view(-1, model.config.hidden_size)
        assert torch.equal(model.lm_head(hidden), reference.lm_head(hidden))
        layer, ref_layer = model.layers[0].mlp, reference.layers[0].mlp
        assert torch.equal(layer(hidden), ref_layer(hidden))


def test_eager_cpu_engine_serves_through_packed_layers(tiny_model) -> None:
    """The default CPU engine packs, and its greedy bf16 output equals the unpacked model's."""
    folder, _, _ = tiny_model
    llm = LLM(folder, dtype="bfloat16", block_size=16, max_num_seqs=4)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    if model.lm_head.small is not None:  # the bf16 small-batch kernel: measured crossovers
        assert model.layers[0].mlp.down_proj.small_rows == 64
        assert model.lm_head.small_rows == 32

    prompts = [[5, 9, 31, 7], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    packed_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    # The same engine with the original dense weights put back.
    dense = load_model(resolve_model_source(folder), "bfloat16", torch.device("cpu")).model
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    dense.get_submodule(name))
    dense_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert packed_out == dense_out
    assert all(len(t) == 12 for t in packed_out)


@dataclass
class Codes:
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def test_small_batches_run_the_int4_codes_and_large_ones_the_dense_weight() -> None:
    if not int4_supported(torch.bfloat16) or not packing_supported(torch.bfloat16):
        pytest.skip("no int4 CPU kernel / bf16 oneDNN here")
    torch.manual_seed(0)
    n, k, group = 48, 128, 32
    codes = Codes(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                  torch.rand(n, k // group) * 0.05, torch.randn(n, k // group) * 0.05)
    weight = (codes.codes.float() - 8) * codes.scale.repeat_interleave(group, 1) \
        + codes.zero.repeat_interleave(group, 1)
    # A dense layer holding *different* weights shows which path each batch took.
    dense = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    layer = SmallBatchInt4Linear(PackedLinear(dense), codes, group, max_rows=4,
                                 dtype=torch.bfloat16)
    for rows in (1, 3, 4):
        x = torch.randn(rows, k).to(torch.bfloat16)
        want = x.float() @ weight.t() + dense.bias.float()
        torch.testing.assert_close(layer(x).float(), want, rtol=0.02, atol=0.05)
    x = torch.randn(2, 3, k).to(torch.bfloat16)  # 6 rows > 4: dense
    assert torch.equal(layer(x), nn.functional.linear(x, dense.weight, dense.bias))


@pytest.mark.slow
def test_engine_serves_a_q4_gguf_from_its_codes_unless_told_not_to() -> None:
    llm = LLM(None, max_num_seqs=4, max_model_len=256)  # the embedded Q4_1 SmolLM2, bf16
    model = llm.engine.runner.model
    int4_layers = [m for m in model.modules() if isinstance(m, SmallBatchInt4Linear)]
    assert len(int4_layers) == 4 * model.config.num_layers
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = llm.tokenizer.encode("The capital of France is")
    with_codes = llm.generate([prompt], params)[0].outputs[0].token_ids
    for layer in int4_layers:
        layer.max_rows = 0  # every batch on the dense bf16 copy of the same file
    dense = llm.generate([prompt], params)[0].outputs[0].token_ids
    # Same file values, different rounding: the greedy continuation must agree.
    assert with_codes == dense
    assert llm.tokenizer.decode(with_codes).strip().startswith("Paris")

    plain = LLM(None, max_num_seqs=4, max_model_len=256, quantization="none")
    assert not any(isinstance(m, SmallBatchInt4Linear) for m in plain.engine.runner.model.modules())


def test_gguf_quantization_needs_a_gguf_file(tiny_model) -> None:
    with pytest.raises(ValueError, match="needs a .gguf"):
        LLM(tiny_model[0], quantization="gguf")
