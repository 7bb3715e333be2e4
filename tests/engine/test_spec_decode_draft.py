"""Speculative decoding with a draft model (vLLM's ``method: draft_model``): a tiny random
target and its truncated-layer copy as the draft (one tokenizer, so acceptance is high).
The draft's KV cache is checked directly: every draft equals what the draft model alone
generates greedily from that sequence's tokens (a stale or missing K/V changes it).
Greedy output equals the target's token for token (both attention paths, n > 1, stops,
logprobs, preemption under a small cache, prefix caching and chunked prefill beside it),
sampling keeps the target's distribution (chi-square), compile mode warms the draft's
buckets before serving (0 serving compilations), and every block is free afterwards."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
from spec_checks import (
    all_free,
    draft_warmed_every_bucket,
    outputs,
    serves_without_compiling,
    spec_llm,
)
from spec_draft import draft_pair

from server import LLM, SamplingParams
from server.config import make_engine_config


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory) -> tuple[str, str]:
    _, model, tokenizer = tiny_model
    return draft_pair(model, tokenizer, tmp_path_factory.mktemp("draft-pair"))


def spec(draft: str, k: int = 3, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **extra}


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist()
            for n in (1, 2, 5, 16, 17, 31, 47, 64, 130)]


def llm(folder: str, config: dict | None, kernels: bool = True, **extra) -> LLM:
    return spec_llm(folder, config, kernels, **extra)


def spy_drafts(engine: LLM) -> list[tuple[list[int], list[int]]]:
    """Records every proposal: (the sequence's tokens, its drafts)."""
    scheduler = engine.engine.scheduler
    assert scheduler.speculation is not None
    propose = scheduler.speculation.propose
    log: list[tuple[list[int], list[int]]] = []

    def recording(seqs, limits):
        drafts = propose(seqs, limits)
        log.extend((s.all_token_ids, d) for s, d in zip(seqs, drafts) if d)
        return drafts

    scheduler.speculation = dataclasses.replace(scheduler.speculation, propose=recording)
    return log


def drafts_are_the_drafts_own(draft: str, log: list[tuple[list[int], list[int]]]) -> None:
    """Each draft is the draft model's own greedy continuation of the sequence: its KV
    cache held the right K/V for every token before it."""
    assert log
    alone = llm(draft, None)
    want = outputs(alone, [tokens for tokens, _ in log],
                   max_tokens=max(len(d) for _, d in log))
    assert [w[0][:len(d)] for w, (_, d) in zip(want, log)] == [d for _, d in log]


@pytest.mark.parametrize("bad, words", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "medusa", "num_speculative_tokens": 2, "model": "x"}, "not supported by this"),
    ({"method": "draft_model", "num_speculative_tokens": 0, "model": "x"}, ">= 1"),
])
def test_config_refusals(bad: dict, words: str) -> None:
    with pytest.raises(ValueError, match="speculative-config") as info:
        make_engine_config(speculative_config=bad)
    assert words in str(info.value)


def test_model_without_method_is_a_draft_model() -> None:
    settings = make_engine_config(speculative_config={
        "model": "/some/draft", "num_speculative_tokens": 4}).speculative.settings
    assert settings is not None and settings.method.value == "draft_model"
    assert settings.model == "/some/draft" and settings.query_len == 5


def test_a_draft_of_another_vocabulary_is_a_startup_error(tiny_model, tmp_path) -> None:
    _, model, tokenizer = tiny_model
    other = copy.deepcopy(model)
    other.resize_token_embeddings(model.config.vocab_size + 64)
    other.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft's vocabulary"):
        llm(tiny_model[0], spec(str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernel", "pytorch"])
def test_greedy_identical_with_a_draft_model(pair, kernels: bool) -> None:
    target, draft = pair
    plain = llm(target, None, kernels)
    drafted = llm(target, spec(draft), kernels)
    batch = prompts(300)
    if not kernels:  # the slow reference attention: the core check only
        batch = batch[::2]
    want = outputs(plain, batch)
    log = spy_drafts(drafted)
    assert outputs(drafted, batch) == want
    drafts_are_the_drafts_own(draft, log)
    if not kernels:
        return
    assert [outputs(drafted, [p])[0] for p in batch[:4]] == want[:4]
    stats = drafted.engine.stats()
    assert stats.spec_num_drafts > 0  # mostly accepted, sometimes rejected
    assert (stats.spec_num_draft_tokens * 0.5 < stats.spec_num_accepted_tokens
            < stats.spec_num_draft_tokens)
    for fields in ({"max_tokens": 7}, {"stop_token_ids": [want[0][0][5]]}):
        assert outputs(drafted, batch, **fields) == outputs(plain, batch, **fields)
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for x, y in zip(drafted.generate(batch[:2], lp), plain.generate(batch[:2], lp)):
        got = [e.logprob for e in x.outputs[0].logprobs]
        ref = [e.logprob for e in y.outputs[0].logprobs]
        assert got == pytest.approx(ref, abs=1e-4)
    seeded = {"n": 3, "temperature": 1.0, "seed": 7}
    assert outputs(drafted, batch, **seeded) == outputs(drafted, batch, **seeded)
    assert all_free(drafted)


@pytest.mark.slow
def test_preemption_prefix_caching_and_chunked_prefill_beside_it(pair) -> None:
    """The draft's cache follows the target's blocks: preempted and recomputed, served
    from the prefix cache (the draft's K/V of a shared block is there too), chunked."""
    target, draft = pair
    batch = prompts(300)
    want = outputs(llm(target, None), batch)
    tight = llm(target, spec(draft), num_gpu_blocks_override=24, enable_prefix_caching=True)
    log = spy_drafts(tight)
    assert outputs(tight, batch) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert all_free(tight)
    cached = llm(target, spec(draft), enable_prefix_caching=True)
    outputs(cached, batch)
    log += spy_drafts(cached)
    assert outputs(cached, batch) == want  # again, the prompts from the prefix cache
    assert cached.engine.stats().prefix_cache_hits >= 128
    chunked = llm(target, spec(draft), enable_chunked_prefill=True,
                  max_num_batched_tokens=48, enable_prefix_caching=True)
    log += spy_drafts(chunked)
    assert outputs(chunked, batch) == want
    assert all_free(chunked)
    drafts_are_the_drafts_own(draft, log)


@pytest.mark.slow
def test_sampled_distribution_is_the_targets(pair) -> None:
    """Chi-square (two samples, 1% significance) on the first three tokens' joint outcome,
    draft model on vs off, with top-k and a presence penalty. (No logit bias: the draft
    proposes its own argmax, which a bias towards other tokens would always reject.)"""
    from scipy.stats import chi2_contingency

    prompt = [11, 12, 13, 14] * 6
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True,
                            presence_penalty=0.5)
    counts = []
    accepted = rejected = 0
    target, draft = pair
    for config in (None, spec(draft, k=2)):
        engine = llm(target, config, max_num_seqs=64)
        outs = engine.generate([prompt] * 1500, params)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
        stats = engine.engine.stats()
        accepted = stats.spec_num_accepted_tokens
        rejected = stats.spec_num_draft_tokens - accepted
    assert accepted > 50 and rejected > 50  # both branches of the rule ran
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(k, 0) + 0.5 for k in keys] for c in counts]
    assert chi2_contingency(table)[1] > 0.01


@pytest.mark.slow
def test_compile_mode_warms_the_draft_and_serves_without_compiling(pair, tmp_path) -> None:
    target, draft = pair
    # a coarse plan of 10 buckets (the default one has 56, ~3 s of C++ each on a cold
    # compile cache), which warmup compiles twice: the target's graphs and the draft's
    buckets = tmp_path / "b.txt"
    buckets.write_text("(1, [32, 64], [0, 4, 8])\n([4], 1, [8, 16])\n")
    engine = LLM(target, dtype="float32", block_size=16, max_num_seqs=4,
                 max_model_len=128, execution_mode="compile",
                 speculative_config=spec(draft),
                 environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    # every planned bucket was compiled on the draft's own graphs before serving
    draft_warmed_every_bucket(engine)
    serves_without_compiling(engine, [p[:60] for p in prompts(300)], 40, 20)
    assert engine.engine.stats().spec_num_accepted_tokens > 0
