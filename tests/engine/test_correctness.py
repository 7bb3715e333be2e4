"""Greedy decoding against Hugging Face transformers, token for token (float32).

Our prompts run together as one continuously-batched workload over the paged KV cache;
the reference runs each prompt alone through ``transformers.generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from server import LLM, SamplingParams

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

NEW_TOKENS = 32


def hf_greedy(model, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    model.generation_config.eos_token_id = None  # else generate() falls back to it and stops
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    generated = out[0, len(prompt_ids):].tolist()
    assert len(generated) == new_tokens  # EOS must not have stopped the reference early
    return generated


def prompt_lengths() -> list[int]:
    # eight different lengths; 45 > 2 blocks of 16 tokens
    return [1, 3, 7, 12, 16, 17, 29, 45]


@pytest.mark.parametrize("kwargs", [dict(tie=True), dict(tie=False),
                                    dict(model_type="qwen3", tie=True),
                                    dict(model_type="granite", tie=False),
                                    dict(model_type="phi3", tie=False),
                                    dict(model_type="mixtral", tie=False),
                                    dict(model_type="qwen3_moe", tie=True),
                                    dict(model_type="gemma2", tie=True)],
                         ids=["tied", "untied", "qwen3", "granite", "phi3", "mixtral",
                              "qwen3-moe", "gemma2"])
def test_tiny_llama_matches_transformers(tiny_model_factory, kwargs: dict) -> None:
    folder, hf_model, _ = tiny_model_factory(num_kv_heads=2, **kwargs)
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lengths()]
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt)
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.slow
def test_embedded_smollm2_matches_transformers(smollm2_gguf) -> None:
    from transformers import AutoModelForCausalLM

    folder, gguf_file = smollm2_gguf
    llm = LLM(dtype="float32", max_num_seqs=8, max_model_len=2048)
    tok = llm.tokenizer
    texts = [
        "Hi",
        "The capital of France is",
        "Write a haiku about the sea.",
        "List three prime numbers:",
        "def fibonacci(n):",
        "Explain paged attention in one sentence.",
        "Translate to French: good morning, how are you today?",
        " ".join(f"Item {i} is a number larger than {i - 1}." for i in range(1, 40)),
    ]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    assert max(len(p) for p in prompts) > 2 * 128  # one prompt spans more than 2 KV blocks
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    hf_model.eval()
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt)


def test_a_sliding_window_no_longer_caps_the_context(tiny_model_factory) -> None:
    """Mistral's window is applied by attention itself: the context is the position limit,
    and outputs equal transformers' well past the window (prompt 40, window 24)."""
    folder, hf_model, _ = tiny_model_factory(model_type="mistral", sliding_window=24)
    llm = LLM(folder, dtype="float32", block_size=16, max_num_seqs=4)
    assert llm.engine.limits.max_model_len == hf_model.config.max_position_embeddings
    prompt = torch.randint(3, hf_model.config.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_model, prompt, 16)
