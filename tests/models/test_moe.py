"""The expert computations of server/models/moe.py against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from server.hpu.layer_ops import TorchLayerOps
from server.models import moe
from server.models.config import ModelConfig

OPS = TorchLayerOps()


def reference(x, w_gate_up, w_down, weights, ids):
    """Each token through the experts it picked, one at a time (HF's down layout: w_down
    here is ours, [E, I, H])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] += w * ((torch.nn.functional.silu(gate) * up) @ w_down[e])
    return out


def random_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    probs = torch.rand(tokens, experts, generator=gen).softmax(-1)
    return probs.topk(top_k, dim=-1)


@pytest.mark.parametrize("plan", [moe.DENSE, 1, 4, 16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 6, 2), (7, 6, 2), (37, 8, 2),
                                                  (3, 16, 4), (50, 4, 1)])
def test_expert_computations_match_per_token_reference(plan, tokens, experts, top_k) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 16, 8
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / 4
    w_down = torch.randn(experts, inter, hidden, generator=gen) / 4
    weights, ids = random_routing(tokens, experts, top_k, gen)
    expected = reference(x, w_gate_up, w_down, weights, ids)
    if plan == moe.DENSE:
        got = moe.dense_experts(x, w_gate_up, w_down, weights, ids, OPS)
    else:
        got = moe.grouped_experts(x, w_gate_up, w_down, weights, ids, OPS, plan)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_grouped_blocks_hold_the_worst_routing() -> None:
    """Every expert one row past a whole block (most padding there can be): the static
    block count is exactly enough."""
    experts, block, top_k = 4, 4, 2
    tokens = experts * (block + 1) // top_k  # each expert picked block + 1 times
    ids = (torch.arange(tokens * top_k) % experts).view(tokens, top_k)
    assert moe.grouped_blocks(tokens, top_k, experts, block) == 2 * experts
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 16, generator=gen)
    w_gate_up = torch.randn(experts, 16, 16, generator=gen) / 4
    w_down = torch.randn(experts, 8, 16, generator=gen) / 4
    weights = torch.rand(tokens, top_k, generator=gen)
    torch.testing.assert_close(
        moe.grouped_experts(x, w_gate_up, w_down, weights, ids, OPS, block),
        reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-5)
    assert moe.grouped_blocks(9, 2, 8, 1) == 18


def test_expert_plan_follows_the_shape() -> None:
    # few experts: all of them at once, except a single decode row of sparse-enough routing
    assert moe.expert_plan(64, 2, 8) == moe.DENSE
    assert moe.expert_plan(512, 2, 8) == moe.DENSE
    # many experts (Qwen3-30B-A3B: 128, top-8): decode gathers, prefill sorts into blocks
    assert moe.expert_plan(1, 8, 128) == 1
    assert moe.expert_plan(4, 8, 128) == 1
    assert moe.expert_plan(2048, 8, 128) > 1


def _config(renormalize: bool) -> ModelConfig:
    return ModelConfig(
        model_type="qwen3_moe", vocab_size=10, hidden_size=16, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
        norm_topk_prob=renormalize, moe_layers=(0,))


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_top_k_weights(renormalize: bool) -> None:
    torch.manual_seed(0)
    block = moe.SparseMoeBlock(_config(renormalize))
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(9, 16)
    weights, ids = block.route(x)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    assert torch.equal(ids, probs.topk(2, dim=-1).indices)
    sums = weights.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(9))
    else:
        torch.testing.assert_close(weights, probs.topk(2, dim=-1).values)
        assert (sums < 1).all()


@pytest.mark.parametrize("tokens", [1, 24])
def test_block_compiles_as_one_graph(tokens: int) -> None:
    """No data-dependent shapes or graph breaks, dense and grouped alike (what compiled
    and captured graphs need); dynamo's eager backend checks that without a compiler."""
    torch.manual_seed(0)
    block = moe.SparseMoeBlock(_config(True))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, tokens, 16)
    compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=False)
    for plan in (moe.DENSE, 1, 8):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe, "expert_plan", lambda *_, plan=plan: plan)
            torch._dynamo.reset()
            torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)
