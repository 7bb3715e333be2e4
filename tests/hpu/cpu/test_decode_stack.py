"""The one-call decode loop (csrc/decode_stack.cpp): the same bits as the model's own layer
loop, on every projection kind it takes, and only where it applies.

Each test runs the same requests with the stack and with the model's loop (the stack taken
off the model) on one engine, and compares token ids and logprobs exactly: the stack makes
the loop's kernel calls, so any difference is a bug. A counting wrapper proves the stack ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from server import LLM, SamplingParams
from server.cache_dir import writable_cache_dir
from server.hpu.attention import AttentionMetadata
from server.hpu.cpu.decode_stack import FusedDecodeStack
from server.hpu.cpu.kernels import load_cpu_kernels

PROMPTS = ["Tell me a story about a cat.", "What is 2+2? Explain.", "List three colors.",
           "Why is the sky blue?", "Write a haiku about rain.", "Name a prime number."]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not load_cpu_kernels(writable_cache_dir() / "kernels"):
        pytest.skip("no C++ compiler: the fused CPU kernels cannot be built")


class Counting:
    """The model's stack, counting the steps it ran."""

    def __init__(self, stack: FusedDecodeStack) -> None:
        self.stack = stack
        self.calls = 0

    def serves(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return self.stack.serves(x, meta)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.stack(*args)


def both_ways(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list, list, int]:
    """(outputs with the stack, outputs with the model's loop, steps the stack ran)."""
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert isinstance(stack, FusedDecodeStack), "the model did not get a decode stack"
    counting = Counting(stack)
    model.decode_stack = counting
    try:
        with_stack = llm.generate(prompts, params)
    finally:
        model.decode_stack = None
    try:
        with_loop = llm.generate(prompts, params)
    finally:
        model.decode_stack = stack
    return with_stack, with_loop, counting.calls


def assert_same(with_stack: list, with_loop: list) -> None:
    for a, b in zip(with_stack, with_loop, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert repr(a.outputs[0].logprobs) == repr(b.outputs[0].logprobs)  # every bit


GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 6])
def test_gguf_int4_projections_give_the_loops_bits(smollm2_gguf, batch: int) -> None:
    """The embedded model: every projection from its 4-bit codes (SmolLM2 has no biases)."""
    folder, name = smollm2_gguf
    llm = LLM(f"{folder}/{name}", max_num_seqs=8, max_model_len=256)
    stack, loop, calls = both_ways(llm, PROMPTS[:batch], GREEDY)
    assert_same(stack, loop)
    assert calls >= GREEDY.max_tokens - 1  # every decode step ran in one call


def test_gguf_with_an_fp8_kv_cache(smollm2_gguf) -> None:
    folder, name = smollm2_gguf
    llm = LLM(f"{folder}/{name}", max_num_seqs=4, max_model_len=256, kv_cache_dtype="fp8")
    stack, loop, calls = both_ways(llm, PROMPTS[:3], GREEDY)
    assert_same(stack, loop)
    assert calls > 0


def test_batches_take_int4_then_bf16_then_onednn_inside(smollm2_gguf) -> None:
    """70 sequences finishing four at a time: the first steps' projections take oneDNN's
    packed weights inside the stack (more rows than the bf16 copy serves), the middle ones
    the bf16 copy, the last ones (8 rows or fewer) the int4 codes."""
    folder, name = smollm2_gguf
    llm = LLM(f"{folder}/{name}", max_num_seqs=70, max_model_len=256)
    prompts = [f"Count to {i}." for i in range(70)]
    params = [SamplingParams(temperature=0, max_tokens=3 + i // 4, logprobs=2,
                             ignore_eos=True) for i in range(70)]
    stack = llm.engine.runner.model.decode_stack
    assert isinstance(stack, FusedDecodeStack) and stack.small_rows == 64
    assert set(stack.params[2::4]) == {8} and set(stack.params[3::4]) == {64}  # int4, bf16
    with_stack, with_loop, calls = both_ways(llm, prompts, params)
    assert_same(with_stack, with_loop)
    assert calls == 3 + 69 // 4 - 1  # every decode step


@pytest.mark.parametrize("kind", [
    {},  # Llama, tied embeddings
    {"model_type": "qwen2"},  # biases on q, k and v
    {"model_type": "mistral", "sliding_window": 6},  # a window shorter than the prompts
    {"model_type": "qwen3"},  # per-head q/k norms, head size != hidden / heads
    {"model_type": "phi3"},
    # sandwich norms in float32 (1 + w), GeGLU, soft-capped scores, windows on alternate layers
    {"model_type": "gemma2", "sliding_window": 6},
    # and q/k norms, the windowed layers on their own RoPE table
    {"model_type": "gemma3_text", "sliding_window": 6},
], ids=["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"])
def test_bf16_projections_give_the_loops_bits(tiny_model_factory, kind: dict) -> None:
    """bf16 weights: every projection on the bf16 small-batch kernel's copy."""
    path = tiny_model_factory(**kind)[0]
    llm = LLM(path, dtype="bfloat16", max_num_seqs=4, max_model_len=128, block_size=16)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(9 + i)] for i in range(3)]
    model = llm.engine.runner.model
    if "sliding_window" in kind:
        assert 6 in {layer.self_attn.window for layer in model.layers}
    if kind.get("model_type") == "gemma3_text":
        assert any(layer.local_rope for layer in model.layers)
        assert model.layers[0].self_attn.q_norm.weight.dtype == torch.float32
    stack, loop, calls = both_ways(llm, [{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_same(stack, loop)
    assert calls >= GREEDY.max_tokens - 1


@pytest.mark.parametrize("kind", [{"model_type": "granite"}, {"model_type": "mixtral"},
                                  {"model_type": "gpt_oss"}])
def test_layers_it_does_not_compute_get_no_stack(tiny_model_factory, kind: dict) -> None:
    """Residual multipliers (Granite), experts (Mixtral), sinks and experts (gpt-oss): the
    model's loop."""
    path = tiny_model_factory(**kind)[0]
    llm = LLM(path, dtype="bfloat16", max_num_seqs=2, max_model_len=128, block_size=16)
    assert llm.engine.runner.model.decode_stack is None


def test_float32_projections_run_onednn_inside(tiny_model_factory) -> None:
    """float32: no small-batch kernel, every projection on oneDNN's packed weight."""
    path = tiny_model_factory(model_type="qwen2")[0]
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=128, block_size=16)
    stack = llm.engine.runner.model.decode_stack
    assert isinstance(stack, FusedDecodeStack) and stack.small_rows == 0
    prompts = [{"prompt_token_ids": [(5 * i + j) % 300 + 3 for j in range(7 + i)]}
               for i in range(3)]
    with_stack, with_loop, calls = both_ways(llm, prompts, GREEDY)
    assert_same(with_stack, with_loop)
    assert calls >= GREEDY.max_tokens - 1


def test_hooked_layers_get_no_stack(tiny_model_factory) -> None:
    path = tiny_model_factory()[0]
    llm = LLM(path, dtype="bfloat16", max_num_seqs=2, max_model_len=128, block_size=16)
    model = llm.engine.runner.model
    assert model.layer_stack_spec() is not None
    # a hook (tensor parallelism's all-reduce is one) would be skipped by the kernel
    model.layers[1].mlp.register_forward_hook(lambda module, args, out: out)
    assert model.layer_stack_spec() is None
