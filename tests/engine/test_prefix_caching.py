"""Automatic prefix caching: outputs identical with it on and off (greedy, fp32), through
both attention paths (the fused CPU kernel and PyTorch's), with shared prefixes, n > 1,
preemption under a tiny cache and aborts; afterwards every block is free again."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams

BLOCK = 16


def engines(folder: str, kernels: bool, **extra) -> tuple[LLM, LLM]:
    env = {"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"}
    common = dict(dtype="float32", block_size=BLOCK, max_num_seqs=8, environ=env, **extra)
    return (LLM(folder, enable_prefix_caching=True, **common),
            LLM(folder, enable_prefix_caching=False, **common))


def prompts_with_shared_prefixes(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(3, vocab, (50,), generator=gen).tolist()  # 3 full blocks + 2
    other = torch.randint(3, vocab, (20,), generator=gen).tolist()
    tails = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 7, 16, 30)]
    return [system + t for t in tails] + [other + t for t in tails] + [system[:32]]


def outputs(llm: LLM, prompts: list[list[int]], **fields) -> list[list[list[int]]]:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 20, "ignore_eos": True,
                               **fields})
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernel", "pytorch"])
def test_outputs_identical_with_and_without_caching(tiny_model, kernels: bool) -> None:
    cached, plain = engines(tiny_model[0], kernels)
    prompts = prompts_with_shared_prefixes(300)
    want = outputs(plain, prompts)
    # one at a time first: later prompts find the earlier ones' blocks
    got = [outputs(cached, [p])[0] for p in prompts]
    assert got == want
    stats = cached.engine.stats()
    # the 3 system-prompt blocks for its 3 later prompts, 1 block of the other prefix for
    # its 3 later prompts, and 1 for system[:32] (its 2nd block holds its last token)
    assert stats.prefix_cache_hits == 3 * 48 + 3 * 16 + 16
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    # then all together, now mostly cached, and n > 1
    assert outputs(cached, prompts) == want
    assert outputs(cached, prompts, n=3, temperature=1.0, seed=5) == \
        outputs(plain, prompts, n=3, temperature=1.0, seed=5)
    assert stats.num_blocks == cached.engine.stats().num_free_blocks
    assert plain.engine.stats().prefix_cache_queries == 0


def test_preemption_and_aborts_release_shared_blocks(tiny_model) -> None:
    cached, plain = engines(tiny_model[0], kernels=True, num_gpu_blocks_override=24)
    prompts = prompts_with_shared_prefixes(300)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in cached.generate(prompts, params)]
    assert got == want
    assert cached.engine.scheduler.num_preemptions > 0
    # aborts mid-flight, shared blocks included
    engine = cached.engine
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"a{i}", p, params)
    engine.step()
    engine.step()
    for i in range(4):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    # reset: nothing is found cached any more
    assert engine.reset_prefix_cache() > 0
    hits = engine.stats().prefix_cache_hits
    cached.generate([prompts[0]], params)
    assert engine.stats().prefix_cache_hits == hits


@pytest.mark.slow  # compile mode (11 s): make test-fast skips it
def test_compile_mode_caches_through_context_buckets(tiny_model, tmp_path) -> None:
    """With compiled graphs a cache hit runs alone in a prompt bucket with context blocks:
    the same tokens as the miss, no bucket miss, no compilation while serving."""
    buckets = tmp_path / "b.txt"
    buckets.write_text("(1, [16, 64], [0, 2, 4])\n(1, 1, [4, 8])\n")
    llm = LLM(tiny_model[0], dtype="float32", block_size=BLOCK, max_num_seqs=1,
              max_model_len=128, execution_mode="compile",
              environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    assert llm.engine.block_manager.enable_caching
    prompt = prompts_with_shared_prefixes(300)[0]  # 51 tokens: 3 full blocks + 3
    first = outputs(llm, [prompt], max_tokens=4)
    assert outputs(llm, [prompt], max_tokens=4) == first
    counters = llm.engine.counters
    assert llm.engine.stats().prefix_cache_hits == 48  # (1, 16, 4): 3 new tokens after 3 blocks
    assert counters.compilations(stage="serving") == 0
    assert sum(counters._misses.labels(counters.model_name, p)._value.get()
               for p in ("prefill", "decode")) == 0
