"""Engine behaviour through the offline API on a tiny random model."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from server import LLM, SamplingParams
from server.config import make_engine_config
from server.engine.errors import RequestError
from server.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model[0], dtype="float32", block_size=16, max_num_seqs=32)


def random_prompts(count: int, vocab: int, seed: int, lo: int = 2, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def test_seeded_sampling_is_batch_invariant(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    target = random_prompts(1, vocab, seed=1)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = random_prompts(15, vocab, seed=2)
    mates = [SamplingParams(temperature=1.0, max_tokens=random.Random(i).randint(4, 30),
                            ignore_eos=True) for i in range(15)]
    mixed = llm.generate(others[:7] + [target] + others[7:], mates[:7] + [params] + mates[7:])
    assert mixed[7].outputs[0].token_ids == alone
    other_seed = llm.generate([target], params.model_copy(update={"seed": 4321}))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_n_completions_and_stop_and_logprobs(llm: LLM) -> None:
    prompt = "the quick brown fox"
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                              ignore_eos=True, logprobs=2))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 12
        assert c.finish_reason == "length"
        assert c.logprobs is not None
        assert len(c.logprobs) == 12
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok
            assert lp.logprob <= 0.0
            assert len(lp.top) == 2
            assert lp.top[0][1] >= lp.top[1][1] >= lp.logprob - 1e-6 or tok in dict(lp.top)

    # A random model likes lone UTF-8 continuation bytes; keep its text printable.
    bias = {i: -100.0 for i in range(llm.tokenizer.vocab_size)
            if "\ufffd" in llm.tokenizer.token_str(i)}
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias=bias)
    greedy = llm.generate(prompt, base)[0]
    text = greedy.outputs[0].text
    assert len(text) > 8
    assert text == llm.tokenizer.decode(greedy.outputs[0].token_ids)
    stop = text[5:8]
    stopped = llm.generate(prompt, base.model_copy(update={"stop": [stop]}))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    # a stop token id ends the sequence at that token
    stop_id = greedy.outputs[0].token_ids[3]
    by_id = llm.generate(prompt, base.model_copy(update={"stop_token_ids": [stop_id]}))[0]
    by_id = by_id.outputs[0]
    first = greedy.outputs[0].token_ids.index(stop_id)
    assert by_id.token_ids == greedy.outputs[0].token_ids[: first + 1]
    assert by_id.stop_reason == stop_id


def test_eos_stops_unless_ignored_and_min_tokens(llm: LLM) -> None:
    eos = next(iter(llm.engine.eos_token_ids))
    bias = {eos: 100.0}  # make EOS the certain choice
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, logit_bias=bias))
    assert out[0].outputs[0].token_ids == [eos]
    assert out[0].outputs[0].finish_reason == "stop"
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=10, logit_bias=bias,
                                               min_tokens=4))
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 5
    assert eos not in ids[:4]
    assert ids[4] == eos
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=6, logit_bias=bias,
                                               ignore_eos=True))
    assert out[0].outputs[0].token_ids == [eos] * 6
    assert out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n"),
        (dict(temperature="hot"), "temperature"),
        (dict(stop=[1, 2]), "stop"),
        (dict(bogus_field=1), "bogus_field"),
        (dict(top_k=2**70), "top_k"),  # would overflow the sampler's int64 tensor
        (dict(min_tokens=10**12), "min_tokens"),
    ],
)
def test_bad_sampling_params_are_typed_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value)


def test_bad_prompts_rejected_and_engine_keeps_serving(llm: LLM) -> None:
    max_len = llm.engine.limits.max_model_len
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(RequestError, match=str(max_len)):
        llm.generate([[5] * (max_len + 1)], SamplingParams())
    with pytest.raises(RequestError, match=r"\d+ in the prompt"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=max_len))
    with pytest.raises(RequestError, match="out of vocabulary"):
        llm.generate([[10**9]], SamplingParams())
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={10**9: 1.0}))
    with pytest.raises(RequestError, match="stop_token_ids"):
        llm.generate("x", SamplingParams(stop_token_ids=[-1], min_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_kv_accounting_with_aborts_and_preemption(tiny_model) -> None:
    """100 requests through a deliberately tiny cache: preemptions happen, aborted requests
    free their blocks, everything else completes, and greedy outputs equal a big cache's."""
    folder = tiny_model[0]
    small = LLMEngine(make_engine_config(model=folder, dtype="float32", block_size=4,
                                         num_gpu_blocks_override=40, max_num_seqs=16))
    vocab = small.model_config.vocab_size
    rng = random.Random(0)
    prompts = random_prompts(100, vocab, seed=3, lo=1, hi=30)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True)
              for _ in prompts]
    to_abort = set(rng.sample(range(100), 15))
    completed: dict[str, list[int]] = {}
    generated: dict[str, list[int]] = {}
    aborted_ids: set[str] = set()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        small.add_request(str(i), p, sp)
    steps = 0
    while small.has_unfinished_requests():
        for out in small.step():
            tokens = generated.setdefault(out.request_id, [])
            tokens += out.outputs[0].token_ids  # each step's delta
            if out.finished:
                completed[out.request_id] = tokens
        steps += 1
        if steps % 7 == 0 and to_abort:  # abort mid-way, wherever the request is
            victim = str(to_abort.pop())
            aborted = small.abort_request(victim)
            if aborted is not None:
                assert aborted.finished
                assert aborted.outputs[0].finish_reason == "abort"
                aborted_ids.add(victim)
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    assert len(aborted_ids) > 5
    assert not aborted_ids & completed.keys()
    assert len(completed) + len(aborted_ids) == 100
    assert all(len(completed[i]) == params[int(i)].max_tokens for i in completed)

    big = LLM(folder, dtype="float32", block_size=4, max_num_seqs=16)
    ids = sorted(completed, key=int)
    reference = big.generate([prompts[int(i)] for i in ids], [params[int(i)] for i in ids])
    assert [r.outputs[0].token_ids for r in reference] == [completed[i] for i in ids]


def test_priority_policy_serves_the_urgent_request_first(tiny_model) -> None:
    llm = LLM(tiny_model[0], dtype="float32", block_size=16, max_num_seqs=1,
              scheduling_policy="priority")
    engine = llm.engine
    for i, priority in enumerate([0, 0, 0, -1]):
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True,
                                                               priority=priority))
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    assert order == ["r3", "r0", "r1", "r2"]


def test_priority_needs_the_priority_policy(llm: LLM) -> None:
    with pytest.raises(RequestError) as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, priority=1))
    assert info.value.param == "priority"
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks
