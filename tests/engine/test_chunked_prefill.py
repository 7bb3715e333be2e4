"""Chunked prefill and mixed steps: greedy (and seeded) outputs identical with chunking on
and off (tiny fp32 models, both attention paths), prompts spanning many chunks, prefix
caching on top, n > 1, preemption under a tiny cache, aborts mid-prefill; afterwards every
block is free."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.config import SchedulerConfig, SchedulerLimits
from server.hpu.types import Phase

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

# what the CPU platform does differently (packed tokens, a smaller step budget): on a GPU
# machine the engine picks CUDA, where neither applies
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform's behaviour")

BLOCK = 16


def llm(folder: str, kernels: bool, chunked: bool, **extra) -> LLM:
    env = {"HPU_SERVE_CPU_KERNELS": "1" if kernels else "0"}
    budget = {"max_num_batched_tokens": 48} if chunked else {}
    return LLM(folder, dtype="float32", block_size=BLOCK, max_num_seqs=8, environ=env,
               enable_chunked_prefill=chunked, **budget, **extra)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    lengths = (5, 47, 48, 49, 130, 200, 17, 96)  # below, at and past the 48-token budget
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def outputs(engine: LLM, batch: list[list[int]], **fields) -> list[list[list[int]]]:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True,
                               **fields})
    return [[c.token_ids for c in o.outputs] for o in engine.generate(batch, params)]


def all_free(engine: LLM) -> bool:
    stats = engine.engine.stats()
    return stats.num_free_blocks == stats.num_blocks and not engine.engine.has_unfinished_requests()


@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernel", "pytorch"])
def test_outputs_identical_with_and_without_chunking(tiny_model, kernels: bool) -> None:
    chunked = llm(tiny_model[0], kernels, chunked=True)
    whole = llm(tiny_model[0], kernels, chunked=False)
    assert chunked.engine.limits.chunked_prefill and not whole.engine.limits.chunked_prefill
    batch = prompts(300)
    want = outputs(whole, batch)
    assert outputs(chunked, batch) == want
    # one at a time too: a lone long prompt takes ceil(200 / 48) steps before its token
    assert [outputs(chunked, [p])[0] for p in batch] == want
    # seeded sampling, n > 1: a chunk short of its prompt's end must not draw from the RNG
    assert outputs(chunked, batch, n=3, temperature=1.0, seed=7) == \
        outputs(whole, batch, n=3, temperature=1.0, seed=7)
    assert all_free(chunked)


def test_chunking_with_prefix_caching_and_preemption(tiny_model) -> None:
    batch = prompts(300)
    shared = batch[5][:100]
    batch += [shared + p[:9] for p in batch[:4]]  # a 100-token common prefix
    whole = llm(tiny_model[0], True, chunked=False)
    params = dict(max_tokens=60)
    want = outputs(whole, batch, **params)
    cached = llm(tiny_model[0], True, chunked=True, enable_prefix_caching=True)
    assert outputs(cached, batch, **params) == want
    assert cached.engine.stats().prefix_cache_hits > 0
    assert all_free(cached)
    tight = llm(tiny_model[0], True, chunked=True, enable_prefix_caching=True,
                num_gpu_blocks_override=30)
    assert outputs(tight, batch, **params) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert all_free(tight)


@cpu_only
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernel", "pytorch"])
def test_decodes_go_on_while_a_long_prompt_is_chunked(tiny_model, kernels: bool) -> None:
    engine = llm(tiny_model[0], kernels, chunked=True).engine
    # eager with the fused kernels packs a step into one forward: the decode rides in the
    # chunk's batch as a one-token chunk; the PyTorch ops run the two back to back
    assert engine.runner.packs_tokens is kernels
    batch = prompts(300)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("short", batch[0], params)
    engine.step()  # its prompt; it decodes from now on
    engine.add_request("long", batch[5], params)  # 200 tokens: 6 chunks, then decodes
    steps = []
    for _ in range(6):
        batches = engine.scheduler.schedule()
        steps.append([(b.phase, [s.request_id for s in b.seqs],
                       [b.new_tokens(i) for i in range(len(b.seqs))]) for b in batches])
        for b in batches:  # run them as the engine would
            engine._step_batch(b)
    chunks = [32] * 5 + [200 - 5 * 32]
    # the decode first, then a chunk in the budget left over (47 tokens), ending on a
    # block boundary (32) unless the rest fits (40 <= 47)
    if kernels:
        assert steps == [[(Phase.PREFILL, ["short", "long"], [1, n])] for n in chunks]
    else:
        assert steps == [[(Phase.DECODE, ["short"], [1]), (Phase.PREFILL, ["long"], [n])]
                         for n in chunks]
    short_seq, long_seq = engine.scheduler.running
    assert long_seq.request_id == "long" and long_seq.num_output_tokens == 1
    assert short_seq.num_output_tokens == 1 + 6  # one token per step, never stalled


def test_abort_mid_prefill_frees_every_block(tiny_model) -> None:
    chunked = llm(tiny_model[0], True, chunked=True, enable_prefix_caching=True)
    engine = chunked.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    batch = prompts(300)
    engine.add_request("long", batch[5], params)
    engine.add_request("other", batch[4], params)
    engine.step()
    engine.step()
    seq = engine.scheduler.running[0]
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens  # mid-prefill
    assert engine.abort_request("long") is not None
    engine.abort_request("other")
    assert all_free(chunked)
    # the aborted prompt's computed blocks are not offered as a cached prefix: only the
    # blocks a finished step wrote are, and the result is still exact
    whole = llm(tiny_model[0], True, chunked=False)
    assert outputs(chunked, batch[4:6]) == outputs(whole, batch[4:6])


def test_max_model_len_beyond_the_budget_only_with_chunking() -> None:
    config = SchedulerConfig(max_num_batched_tokens=512, max_model_len=16384)
    limits = SchedulerLimits.resolve(config, 32768, chunked_prefill=True)
    assert limits.max_model_len == 16384 and limits.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="not chunked"):
        SchedulerLimits.resolve(config, 32768, chunked_prefill=False)
    # unset budget: 2048 per step with chunking, a whole prompt without
    default = SchedulerConfig(max_model_len=16384)
    assert SchedulerLimits.resolve(default, 32768, True).max_num_batched_tokens == 2048
    assert SchedulerLimits.resolve(default, 32768, False).max_num_batched_tokens == 16384
    # the platform's budget replaces 2048 when chunking; the flag still wins
    assert SchedulerLimits.resolve(default, 32768, True, default_max_num_batched_tokens=512
                                   ).max_num_batched_tokens == 512
    assert SchedulerLimits.resolve(config, 32768, True, default_max_num_batched_tokens=256
                                   ).max_num_batched_tokens == 512


@cpu_only
def test_cpu_serves_a_smaller_step_budget_by_default(tiny_model) -> None:
    """CPU steps are compute-bound: 512 tokens per step unless the flag says otherwise."""
    engine = LLM(tiny_model[0], dtype="float32").engine
    assert engine.limits.chunked_prefill and engine.limits.max_num_batched_tokens == 512
    assert engine.runner.limits.max_num_batched_tokens == 512
    flagged = LLM(tiny_model[0], dtype="float32", max_num_batched_tokens=1024).engine
    assert flagged.limits.max_num_batched_tokens == 1024


def test_smollm2_identical_with_chunking_and_caching_on_and_off(smollm2_gguf) -> None:
    """The embedded model in fp32: long prompts over 96-token chunks, a shared prefix
    cached, against one whole-prompt step with nothing cached."""
    folder, gguf_file = smollm2_gguf
    path = f"{folder}/{gguf_file}"
    common = dict(dtype="float32", block_size=16, max_num_seqs=4, max_model_len=1024)
    on = LLM(path, enable_chunked_prefill=True, enable_prefix_caching=True,
             max_num_batched_tokens=96, **common)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(100, 40000, (200,), generator=gen).tolist()
    batch = [shared + torch.randint(100, 40000, (n,), generator=gen).tolist()
             for n in (10, 150, 333)] + [torch.randint(100, 40000, (450,), generator=gen).tolist()]
    got = [outputs(on, [p], max_tokens=12)[0] for p in batch]  # one by one: later ones hit
    assert on.engine.stats().prefix_cache_hits >= 2 * 192
    del on
    off = LLM(path, enable_chunked_prefill=False, enable_prefix_caching=False, **common)
    assert outputs(off, batch, max_tokens=12) == got
