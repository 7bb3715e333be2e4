"""LoRA at --tensor-parallel-size 2 (CPU, gloo): each rank holds its part of every slot
(B cut by output columns on q/k/v and gate/up, A by input columns on o and down), and the
greedy tokens of base + two adapters sharing steps equal transformers with each PEFT
adapter merged into the base."""

from __future__ import annotations

import pytest
import torch

from server import LLM, LoRARequest, SamplingParams
from server.models.config import ModelConfig
from server.models.lora import load_peft_adapter
from server.models.lora.ops import lora_dense, slot_mask
from server.models.lora.peft import LoRASite, site_shapes
from server.models.tensor_parallel import ShardPlan
from tests.lora.conftest import LLAMA_TARGETS, PHI3_TARGETS, hf_greedy, merged

NEW_TOKENS = 10


def _config(folder: str) -> ModelConfig:
    from server.models.loader import load_model_config, resolve_model_source

    return load_model_config(resolve_model_source(folder))


@pytest.mark.parametrize("model_type,targets", [("llama", LLAMA_TARGETS),
                                                ("phi3", PHI3_TARGETS)])
def test_rank_parts_sum_to_the_whole_delta(tiny_model_factory, adapter_factory,
                                           model_type: str, targets: list[str]) -> None:
    """Per site, the ranks' deltas, put together as the model does (column-parallel:
    concatenated per part; row-parallel: summed by the all-reduce), are the whole delta."""
    folder, hf_model, _ = tiny_model_factory(model_type=model_type, num_kv_heads=2, tie=False)
    cfg = _config(folder)
    adapter = load_peft_adapter(adapter_factory(hf_model, 8, targets, seed=4), cfg, 8,
                                torch.float32)
    plans = [ShardPlan.build(cfg, rank, 2) for rank in range(2)]
    parts = [plan.shard_lora(adapter) for plan in plans]
    mask = slot_mask(torch.ones(5, dtype=torch.long), 1, torch.float32)
    d, q_all = cfg.head_dim, cfg.num_heads * cfg.head_dim
    kv_all = cfg.num_kv_heads * d
    for (layer, site), (a, bt) in adapter.weights.items():
        def delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                  held: ModelConfig) -> torch.Tensor:
            parts = site_shapes(held)[site].parts  # one slot: A [P, 1, r, in]
            return lora_dense(x, a.view(len(parts), 1, -1, a.shape[1]), bt.unsqueeze(0),
                              mask, parts)

        x = torch.randn(5, a.shape[1])
        whole = delta(x, a, bt, cfg)
        ranks = [(p.weights[(layer, site)], plan) for p, plan in zip(parts, plans)]
        if site in (LoRASite.O, LoRASite.DOWN):  # row-parallel: input columns, summed
            width = a.shape[1] // 2
            total = sum(delta(x[:, i * width:(i + 1) * width], ra, rbt, plan.rank_config())
                        for i, ((ra, rbt), plan) in enumerate(ranks))
            torch.testing.assert_close(total, whole)
            continue
        outs = [delta(x, ra, rbt, plan.rank_config()) for (ra, rbt), plan in ranks]
        if site is LoRASite.GATE_UP:  # each rank: its gate columns, then its up columns
            half = whole.shape[1] // 2
            gate = torch.cat([o[:, : o.shape[1] // 2] for o in outs], dim=1)
            up = torch.cat([o[:, o.shape[1] // 2:] for o in outs], dim=1)
            torch.testing.assert_close(torch.cat([gate, up], dim=1), whole)
            assert gate.shape[1] == half
        else:  # QKV: each rank its q heads, then its k and v heads
            q = torch.cat([o[:, : q_all // 2] for o in outs], dim=1)
            k = torch.cat([o[:, q_all // 2: q_all // 2 + kv_all // 2] for o in outs], dim=1)
            v = torch.cat([o[:, q_all // 2 + kv_all // 2:] for o in outs], dim=1)
            torch.testing.assert_close(torch.cat([q, k, v], dim=1), whole)


def _prompts(vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(4, 30, (count,), generator=gen)]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,targets", [("llama", LLAMA_TARGETS),
                                                ("phi3", PHI3_TARGETS)])
def test_tp2_base_and_two_adapters_match_merged_references(
        tiny_model_factory, adapter_factory, model_type: str, targets: list[str]) -> None:
    folder, hf_model, _ = tiny_model_factory(model_type=model_type, num_kv_heads=2, tie=False)
    a = adapter_factory(hf_model, 8, targets, seed=11)
    b = adapter_factory(hf_model, 16, targets, seed=12, rslora=True, alpha=8)
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=8, max_model_len=256,
              tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        loras = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b)] * 2
        prompts = _prompts(hf_model.config.vocab_size, len(loras))
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params, lora_request=loras)
    finally:
        llm.shutdown()
    refs = {None: hf_model, 1: merged(hf_model, a), 2: merged(hf_model, b)}
    for prompt, lora, out in zip(prompts, loras, outputs):
        ref = refs[lora.lora_int_id if lora else None]
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS), lora
        if lora is not None:  # the adapter does change the answer (else this proves nothing)
            assert out.outputs[0].token_ids != hf_greedy(hf_model, prompt, NEW_TOKENS)
