"""Speculative decoding (n-gram): the config's checks, the proposer, greedy identity with
speculation on and off (both attention paths, compile mode with zero serving compilations),
the sampled distribution kept (chi-square), stops inside an accepted run, preemption and
prefix caching beside it, and every block free afterwards."""

from __future__ import annotations

import collections
import importlib.util
from pathlib import Path

import pytest
import torch
from spec_checks import all_free, outputs, serves_without_compiling, spec_llm

from server import LLM, SamplingParams
from server.config import make_engine_config, parse_speculative_config
from server.engine.core.sequence import Sequence
from server.engine.spec_decode.ngram import NgramProposer

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}


@pytest.mark.parametrize("bad, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs \"model\": the eagle head's"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method 'medusa' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unsupported key(s) foo"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "\"method\" is required"),
])
def test_unsupported_config_is_a_startup_error(bad: dict, words: str) -> None:
    with pytest.raises(ValueError, match="speculative-config") as info:
        make_engine_config(speculative_config=bad)
    assert words in str(info.value)


def test_config_json_and_dict_agree() -> None:
    from_dict = make_engine_config(speculative_config=SPEC).speculative.settings
    assert from_dict == parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3}')
    only_max = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)  # vLLM's rule
    assert from_dict is not None and from_dict.query_len == 4


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    propose = NgramProposer(parse_speculative_config(SPEC)).propose

    def seq(tokens: list[int]) -> Sequence:
        return Sequence(0, "r", 0, tokens, SamplingParams(), 0.0)

    assert propose(seq([1, 2, 3, 9, 2, 3, 7, 7, 2, 3]), 5) == [7, 7, 2]
    assert propose(seq([7, 8, 9] * 4), 5) == [7, 8, 9]  # a full run, not the overlap
    assert propose(seq([1, 2, 3, 4]), 5) == []
    assert propose(seq([1, 2, 1, 2]), 1) == [1]
    # token ids above 255: matches are token-aligned, never across byte boundaries
    assert propose(seq([256, 1, 2, 512, 1, 2]), 3) == [512, 1, 2]


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    repetitive = [list(range(5, 25)) * 4, [7, 8, 9] * 10, list(range(40, 57)) * 3]
    return repetitive + [torch.randint(3, vocab, (n,), generator=gen).tolist()
                         for n in (1, 5, 16, 47, 130)]


def llm(folder: str, spec: dict | None, kernels: bool = True, **extra) -> LLM:
    return spec_llm(folder, spec, kernels, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernel", "pytorch"])
def test_greedy_identical_with_speculation(tiny_model, kernels: bool) -> None:
    plain = llm(tiny_model[0], None, kernels)
    spec = llm(tiny_model[0], SPEC, kernels)
    batch = prompts(300)
    want = outputs(plain, batch)
    assert outputs(spec, batch) == want
    assert [outputs(spec, [p])[0] for p in batch] == want  # batch of one: every draft used
    stats = spec.engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0
    assert stats.spec_accepted_per_pos[0] >= stats.spec_accepted_per_pos[-1]
    # stops inside an accepted run cut there: max_tokens and a stop token id
    for fields in ({"max_tokens": 7}, {"stop_token_ids": [want[0][0][5]]}):
        assert outputs(spec, batch, **fields) == outputs(plain, batch, **fields)
    # logprobs are the target's
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    a = spec.generate(batch[:2], lp)
    b = plain.generate(batch[:2], lp)
    for x, y in zip(a, b):
        got = [e.logprob for e in x.outputs[0].logprobs]
        ref = [e.logprob for e in y.outputs[0].logprobs]
        assert got == pytest.approx(ref, abs=1e-4)
    # seeded sampling, n > 1: reproducible with speculation on
    seeded = {"n": 3, "temperature": 1.0, "seed": 7}
    assert outputs(spec, batch, **seeded) == outputs(spec, batch, **seeded)
    assert all_free(spec)


@pytest.mark.slow
def test_greedy_identical_with_speculation_in_bfloat16(smollm2_gguf) -> None:
    """bf16 weights (the embedded model's dense copy): a verify step's k + 1 rows and a
    decode step's one row go through the bf16 small-batch kernel, whose rows do not depend
    on the batch. With oneDNN's GEMM at every row count the texts differed (it rounds a row
    differently at 1 and 5 rows, and near-ties flip)."""
    # benchmarks/spec_decode.py's copy, quote and code-edit prompts
    bench = importlib.util.spec_from_file_location(
        "spec_decode_bench", Path(__file__).parents[2] / "benchmarks" / "spec_decode.py")
    assert bench is not None and bench.loader is not None
    module = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(module)

    folder, name = smollm2_gguf
    common = {"dtype": "bfloat16", "quantization": "none", "max_model_len": 1024,
              "max_num_seqs": 4}
    plain = LLM(f"{folder}/{name}", **common)
    spec = LLM(f"{folder}/{name}", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}, **common)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    chats = [[{"role": "user", "content": text}] for text in module.GROUNDED]
    want = [o.outputs[0].token_ids for o in plain.chat(chats, params)]
    got = [spec.chat([chat], params)[0].outputs[0].token_ids for chat in chats]
    assert got == want
    assert spec.engine.stats().spec_num_accepted_tokens > 100


@pytest.mark.slow
def test_preemption_prefix_caching_and_chunked_prefill_beside_it(tiny_model) -> None:
    batch = prompts(300)
    want = outputs(llm(tiny_model[0], None), batch)
    tight = llm(tiny_model[0], SPEC, num_gpu_blocks_override=24, enable_prefix_caching=True)
    assert outputs(tight, batch) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert outputs(tight, batch) == want  # again, from the prefix cache
    assert all_free(tight)
    chunked = llm(tiny_model[0], SPEC, enable_chunked_prefill=True,
                  max_num_batched_tokens=48, enable_prefix_caching=True)
    assert outputs(chunked, batch) == want
    assert all_free(chunked)


@pytest.mark.slow
def test_disable_by_batch_size_turns_it_off(tiny_model) -> None:
    spec = llm(tiny_model[0], {**SPEC, "disable_by_batch_size": 2})
    batch = prompts(300)[:3] * 2
    outputs(spec, batch, max_tokens=4)  # six running: plain decodes only
    assert spec.engine.stats().spec_num_drafts == 0
    outputs(spec, batch[:1], max_tokens=8)
    assert spec.engine.stats().spec_num_drafts > 0


@pytest.mark.slow
def test_sampled_distribution_is_the_targets(tiny_model) -> None:
    """Chi-square (two samples, 1% significance) on the first three tokens' joint outcome
    of a repetitive prompt whose continuation the biased top-4 makes likely (so drafts are
    proposed, and both accepted and rejected)."""
    from scipy.stats import chi2_contingency

    prompt = [11, 12, 13, 14] * 6
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, n=1,
                            logit_bias={11: 4.0, 12: 4.0, 13: 4.0, 14: 4.0},
                            presence_penalty=0.5)
    counts = []
    accepted = 0
    for spec in (None, SPEC):
        engine = llm(tiny_model[0], spec, max_num_seqs=64)
        outs = engine.generate([prompt] * 1500, params)
        counts.append(collections.Counter(tuple(o.outputs[0].token_ids) for o in outs))
        accepted = engine.engine.stats().spec_num_accepted_tokens
    assert accepted > 100
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c.get(k, 0) + 0.5 for k in keys] for c in counts]
    assert chi2_contingency(table)[1] > 0.01


@pytest.mark.slow
def test_compile_mode_serves_without_compiling(tiny_model, tmp_path) -> None:
    """Verify buckets (4 tokens a row) are planned from the decode buckets and warmed: a
    random mix with drafts, prefix-cache hits and padding compiles nothing and misses no
    bucket. A coarse plan of 10 graphs (the default one has 56: ~3 s of C++ each on a
    cold compile cache); every prompt (up to 40 tokens) fits one query bucket."""
    buckets = tmp_path / "b.txt"
    buckets.write_text("(1, [32, 64], [0, 4, 8])\n([4], 1, [8, 16])\n")
    engine = LLM(tiny_model[0], dtype="float32", block_size=16, max_num_seqs=4,
                 max_model_len=128, execution_mode="compile", speculative_config=SPEC,
                 environ={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    shapes = engine.engine.runner.shapes.buckets
    assert sorted({b.query for bs in shapes.values() for b in bs}) == [1, 4, 32, 64]
    serves_without_compiling(engine, [p[:60] for p in prompts(300)], 40, 30)
    assert engine.engine.stats().spec_num_accepted_tokens > 0
