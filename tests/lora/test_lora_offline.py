"""Adapters served in shared batches, token for token against transformers with each PEFT
adapter merged into the base (float32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from server import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import LLAMA_TARGETS, PHI3_TARGETS, hf_greedy, merged

NEW_TOKENS = 12


def _prompts(vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 40, (count,), generator=gen)]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,targets", [
    ("llama", LLAMA_TARGETS), ("qwen3", LLAMA_TARGETS), ("phi3", PHI3_TARGETS)])
def test_base_and_two_adapters_share_steps(tiny_model_factory, adapter_factory,
                                           model_type: str, targets: list[str]) -> None:
    folder, hf_model, _ = tiny_model_factory(model_type=model_type, num_kv_heads=2, tie=False)
    a = adapter_factory(hf_model, 8, targets[:3] if model_type != "phi3" else targets, seed=1)
    b = adapter_factory(hf_model, 16, targets, seed=2, rslora=True, alpha=8)
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=8, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    loras = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b)] * 2
    prompts = _prompts(hf_model.config.vocab_size, len(loras))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=loras)
    refs = {None: hf_model, 1: merged(hf_model, a), 2: merged(hf_model, b)}
    for prompt, lora, out in zip(prompts, loras, outputs):
        ref = refs[lora.lora_int_id if lora else None]
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS), lora
        if lora is not None:  # the adapter does change the answer (else this proves nothing)
            assert out.outputs[0].token_ids != hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_eager_steps_without_adapter_skip_lora(tiny_model, adapter_factory, monkeypatch
                                               ) -> None:
    """With --enable-lora, an eager step in which no row has an adapter runs no LoRA op at
    all (the host knows: no slot input); a step with one runs it in every layer, as the
    fused CPU kernel."""
    from server.models.lora import slots as slot_module

    calls = []
    for name in ("lora_dense", "lora_kernel"):  # the PyTorch op, or the fused CPU one
        real = getattr(slot_module, name)
        monkeypatch.setattr(slot_module, name, lambda *args, real=real, **kwargs:
                            calls.append(real.__name__) or real(*args, **kwargs))
    folder, hf_model, _ = tiny_model
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=4, enable_lora=True,
              max_loras=1, max_lora_rank=8, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    assert calls == []
    llm.generate([[5, 6, 7]], params,
                 lora_request=LoRARequest("a", 1, adapter_factory(hf_model, 8, seed=1)))
    assert calls
    # eager CPU with its fused kernels (the default, built where a compiler exists): the
    # fused LoRA kernel serves every projection
    assert set(calls) == {"lora_kernel"}
