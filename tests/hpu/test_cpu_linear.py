"""oneDNN-packed linear layers: same numbers as ``F.linear``, swapped in only for eager CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from server import LLM, SamplingParams
from server.hpu.cpu_linear import PackedLinear, pack_linear_layers, packing_supported
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
        assert got.shape == want.shape and got.dtype == dtype
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
