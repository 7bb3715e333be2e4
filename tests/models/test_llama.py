"""The model and paged attention against transformers' own implementation, logits level."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from server.engine.core.block_manager import BlockManager
from server.engine.core.sequence import Sequence
from server.engine.sampling_params import SamplingParams
from server.models.loader import load_model, resolve_model_source

BLOCK = 8
# LongRoPE over a 64-token original context (head_dim 16: 8 factors each)
PHI3_LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                     long_factor=[2.0 + i / 4 for i in range(8)])
PROMPT_LENS = (3, 17, 9, 30)  # prefilled together: [4, 30] right-padded


def run_prefill_then_decode(folder: str, prompts: list[list[int]], steps: int,
                            inspect: Callable[[torch.nn.Module], object] | None = None,
                            block: int = BLOCK):
    """Prefill all prompts as one padded batch, then decode `steps` tokens (teacher-forced
    with the reference's tokens), returning our logits per step. ``inspect`` sees the
    loaded model first (to hook it)."""
    from server.engine.worker.input_builder import InputBuilder
    from server.engine.worker.model_runner import ModelForward

    loaded = load_model(resolve_model_source(folder), "float32", torch.device("cpu"))
    if inspect is not None:
        inspect(loaded.model)
    cfg = loaded.config
    bm = BlockManager(64, block)
    kv = cfg.kv_layout.allocate(64, block, torch.float32, torch.device("cpu"))
    forward = ModelForward(loaded.model, kv)
    inputs = InputBuilder(block, bm.pad_block_id, torch.device("cpu"), torch.float32, 4096)
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(), 0.0) for i, p in enumerate(prompts)]
    for s in seqs:
        bm.allocate(s)
    with torch.inference_mode():
        logits = [forward(inputs.prefill(seqs))]
        for _ in range(steps):
            for s, row in zip(seqs, logits[-1]):
                s.output_token_ids.append(int(row.argmax()))
                bm.append_slot(s)
            logits.append(forward(inputs.decode(seqs)))
    return seqs, logits


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tie=True, num_kv_heads=2),
        dict(tie=False, num_kv_heads=1),
        dict(model_type="qwen2", tie=False, num_kv_heads=2),
        dict(model_type="mistral", tie=True, num_kv_heads=4),
        dict(model_type="qwen3", tie=True, num_kv_heads=2),
        dict(model_type="granite", tie=True, num_kv_heads=2),
        dict(model_type="phi3", tie=False, num_kv_heads=2, rope_scaling=PHI3_LONGROPE),
        dict(model_type="mixtral", tie=False, num_kv_heads=2),
        dict(model_type="qwen3_moe", tie=True, num_kv_heads=2),
        dict(model_type="gemma2", tie=True, num_kv_heads=2),
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=64)),
    ],
    ids=["llama-tied-gqa", "llama-untied-mqa", "qwen2-bias", "mistral-mha", "qwen3-qk-norm",
         "granite-multipliers", "phi3-longrope", "mixtral-moe", "qwen3-moe", "gemma2", "llama3-rope"],
)
def test_logits_match_transformers(tiny_model_factory, kwargs) -> None:
    assert_logits_match(*tiny_model_factory(**kwargs)[:2])


def assert_logits_match(folder: str, hf_model: torch.nn.Module,
                        inspect: Callable[[torch.nn.Module], object] | None = None,
                        prompt_lens: tuple[int, ...] = PROMPT_LENS, steps: int = 6,
                        block: int = BLOCK) -> None:
    """Our logits equal transformers' at every prefill and decode step of four prompts."""
    gen = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    seqs, ours = run_prefill_then_decode(folder, prompts, steps=steps, inspect=inspect,
                                         block=block)
    for row, seq in enumerate(seqs):
        ids = torch.tensor([seq.all_token_ids])
        with torch.no_grad():
            ref = hf_model(ids).logits[0].float()
        n = len(prompts[row])
        for step, logits in enumerate(ours):
            torch.testing.assert_close(logits[row], ref[n - 1 + step], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("block", [1, 4])
def test_moe_grouped_experts_match_transformers(tiny_model_factory, monkeypatch, block) -> None:
    """The grouped expert computation (the tiny shapes pick the dense one): the experts
    each token picked, sorted into blocks of ``block`` rows (1: one gathered weight slice
    per token and slot, as decode of a many-expert model runs)."""
    from server.models import moe

    shapes = []

    def plan(tokens: int, top_k: int, num_experts: int) -> int:
        shapes.append(tokens)
        return block

    monkeypatch.setattr(moe, "expert_plan", plan)
    assert_logits_match(*tiny_model_factory(model_type="qwen3_moe", tie=True, num_kv_heads=2)[:2])
    assert 4 * 30 in shapes and 4 in shapes  # prefill and decode both went the grouped way


@pytest.mark.parametrize("model_type,tie", [("mixtral", False), ("qwen3_moe", True)])
def test_moe_router_spreads_tokens_over_experts(tiny_model_factory, model_type, tie) -> None:
    """The tiny MoE models route the test prompts to several experts in every sparse layer
    (a router collapsed onto one or two experts would leave most expert weights untested);
    Qwen3-MoE's dense layer keeps its plain MLP."""
    from server.models.llama import MLP
    from server.models.moe import SparseMoeBlock

    folder, hf_model, _ = tiny_model_factory(model_type=model_type, tie=tie, num_kv_heads=2)
    picked: dict[int, set[int]] = {}

    def record(index: int, block: SparseMoeBlock, x: torch.Tensor) -> None:
        bs, q, hidden = x.shape
        ids = block.route(x.reshape(-1, hidden))[1].view(bs, q, -1)
        for row in range(bs):  # the prompts' own tokens, not the prefill's right padding
            real = ids[row, : PROMPT_LENS[row]] if q > 1 else ids[row]
            picked.setdefault(index, set()).update(real.flatten().tolist())

    def hook_routers(model: torch.nn.Module) -> None:
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.register_forward_hook(
                    lambda mod, args, out, i=i: record(i, mod, args[0]))
            else:
                assert isinstance(layer.mlp, MLP)

    assert_logits_match(folder, hf_model, inspect=hook_routers)
    sparse = [0, 2] if model_type == "qwen3_moe" else [0, 1]
    assert sorted(picked) == sparse
    assert all(len(experts) >= 3 for experts in picked.values()), picked
