"""Structured outputs in the engine: grammars compiled per request, a token mask per step,
guided and unguided requests in the same batches."""

from __future__ import annotations

import json
import math
import random
import re
import time

import pytest
import torch

from server import LLM, SamplingParams
from server.config import StructuredOutputsConfig
from server.engine.errors import RequestError
from server.engine.sampling_params import StructuredOutputsParams as Spec
from server.engine.structured_outputs.backend import (
    GrammarCache,
    GrammarState,
    StructuredOutputs,
)
from server.engine.structured_outputs.limits import (
    GrammarKind,
    GrammarSource,
    checked_source,
    client_message,
    count_alternatives,
)
from server.engine.worker.sampler import apply_bitmask

DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model[0], dtype="float32", block_size=16, max_num_seqs=16)


def texts(outputs: list) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def test_bitmask_bits_allow_exactly_their_tokens() -> None:
    logits = torch.zeros(2, 70)
    words = torch.zeros(2, 3, dtype=torch.int32)
    words[0, 0] = 1 - 2**31  # bits 0 and 31 (int32 two's complement): tokens 0 and 31
    words[0, 2] = 1 << 5  # token 69
    words[1] = -1  # everything
    masked = apply_bitmask(logits, words)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0, 31, 69]
    assert torch.isfinite(masked[1]).all()


def test_grammar_starts_after_its_marker_as_text() -> None:
    pieces = {1: "abc", 7: "</th", 8: "ink", 9: ">\n", 10: "x</think>"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    state = GrammarState(matcher=None, start_after="</think>", decode=decode)
    for upto in ([1], [1, 7], [1, 7, 8]):
        state.observe(upto)
        assert not state.active
    state.observe([1, 7, 8, 9])  # the marker split over three tokens
    assert state.active
    other = GrammarState(matcher=None, start_after="</think>", decode=decode)
    other.observe([1, 10])  # inside one token with text before it
    assert other.active


def test_constraint_applies_only_after_the_reasoning_end(llm: LLM) -> None:
    """Free text first (the reasoning), the grammar from the marker on: the marker is a
    token the model writes anyway, so the text up to it is the unconstrained text."""
    tok = llm.engine.tokenizer
    seeded = dict(temperature=1.0, seed=5)  # the same draws: the same text up to the marker
    free = llm.generate("the quick", SamplingParams(max_tokens=12, ignore_eos=True,
                                                     **seeded))[0].outputs[0]
    k = next(k for k in range(2, 12) if tok.decode([free.token_ids[k]]).strip()
             and tok.decode([free.token_ids[k]]) not in tok.decode(free.token_ids[:k]))
    marker = tok.decode([free.token_ids[k]])
    out = llm.generate("the quick", SamplingParams(
        max_tokens=30, structured_outputs=Spec(regex=r"[0-9]{3}", start_after=marker),
        **seeded))[0].outputs[0]
    head, sep, tail = out.text.partition(marker)
    assert head + sep == tok.decode(free.token_ids[:k + 1])
    assert re.fullmatch(r"[0-9]{3}", tail), out.text
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("spec, field", [
    (Spec(json='{"type": "object", "properties": ', field="guided_json"), "guided_json"),
    (Spec(regex="(unclosed", field="guided_regex"), "guided_regex"),
    (Spec(grammar="root ::= undefined_rule", field="structured_outputs"), "structured_outputs"),
    (Spec(json={"type": "no-such-type"}, field="response_format"), "response_format"),
])
def test_invalid_constraints_are_request_errors_naming_the_field(llm: LLM, spec: Spec,
                                                                  field: str) -> None:
    with pytest.raises(RequestError) as info:
        llm.generate("the quick", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert info.value.param == field
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_constrained_outputs_with_unconstrained_ones_in_the_same_batches(llm: LLM) -> None:
    prompt = "numbers 1 2"
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = texts(llm.generate([prompt], free))
    specs = [Spec(regex=DATE), Spec(choice=["red", "green", "blue", "cyan", "magenta"]),
             Spec(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
             Spec(json={"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False})]
    params = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=40,
                             structured_outputs=spec) for i, spec in enumerate(specs)]
    outputs = llm.generate([prompt] * 5, params[:2] + [free] + params[2:])
    assert texts(outputs[2:3]) == alone  # rows without a grammar are not masked
    date, choice, _, tuple_, obj = (o.outputs for o in outputs)
    assert all(re.fullmatch(DATE, c.text) for c in date)
    assert all(c.text in {"red", "green", "blue", "cyan", "magenta"} for c in choice)
    assert all(re.fullmatch(r"\(\d+(,\d+)*\)", c.text) for c in tuple_)
    assert all(isinstance(json.loads(c.text)["n"], int) for c in obj)
    assert all(c.finish_reason == "stop" for o in outputs if o is not outputs[2]
               for c in o.outputs)


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    out = llm.generate("the quick", SamplingParams(
        temperature=1.0, seed=1, max_tokens=8, logprobs=5,
        structured_outputs=Spec(choice=["yes", "no"])))[0].outputs[0]
    first = out.logprobs[0]
    allowed = [lp for _, lp in first.top if math.isfinite(lp)]
    assert 1 <= len(allowed) < 5  # only a few tokens can start "yes" or "no"
    assert math.isclose(sum(math.exp(lp) for lp in allowed), 1.0, rel_tol=1e-4)
    assert math.isfinite(first.logprob)


def test_guided_outputs_survive_preemption(tiny_model) -> None:
    """A tiny cache forces preemption by recompute: the matchers keep their state (the
    tokens are kept) and outputs equal the same requests run with a roomy cache."""
    specs = [Spec(regex=r"[a-z]{10,30}"), Spec(json={"type": "array", "items": {
        "enum": [1, 22, 333]}, "minItems": 8, "maxItems": 8})]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=s)
              for i, s in enumerate(specs * 4)]
    prompts = [[3 + (7 * i + j) % 200 for j in range(40)] for i in range(8)]
    small = LLM(tiny_model[0], dtype="float32", block_size=4, num_gpu_blocks_override=40,
                max_num_seqs=8)
    together = texts(small.generate(prompts, params))
    assert small.engine.scheduler.num_preemptions > 0
    roomy = LLM(tiny_model[0], dtype="float32", block_size=4, max_num_seqs=8)
    assert together == texts(roomy.generate(prompts, params))
    assert all(len(json.loads(t)) == 8 for t in together[1::2])


@pytest.mark.parametrize("fields", [dict(min_tokens=5), dict(min_tokens=3, ignore_eos=True),
                                    dict(logit_bias={0: -100.0})])
def test_a_grammar_that_can_only_end_wins_over_min_tokens(llm: LLM, fields: dict) -> None:
    """An empty regex allows nothing but the end; min_tokens forbids the end. The grammar
    decides: the request ends (found by the API fuzzer as a 500)."""
    for temperature in (0.0, 1.0):
        out = llm.generate("the quick", SamplingParams(
            temperature=temperature, max_tokens=8, structured_outputs=Spec(regex=""),
            **fields))[0].outputs[0]
        assert out.text == ""
        assert out.finish_reason == "stop"
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_stop_strings_end_a_guided_output(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=3, stop=["e"],
                            structured_outputs=Spec(regex=r"[a-h]{30}"))
    for c in llm.generate("the quick", params)[0].outputs:
        assert re.fullmatch(r"[a-dfgh]*", c.text), c.text  # the grammar's letters, up to "e"
        assert c.finish_reason == "stop"
        assert c.stop_reason == "e" or len(c.text) == 30


# -- bounded grammar work ------------------------------------------------------------------

def slow_schema(tag: str, n: int = 8000) -> dict:
    """~10 s to compile with the tiny vocabulary (long multi-word enum values)."""
    rng = random.Random(tag)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota"]
    return {"enum": [" ".join(rng.choice(words) for _ in range(8)) + f" {tag}{i}"
                     for i in range(n)]}


@pytest.fixture()
def bounded(tiny_model):
    """A backend with a short compile limit and caps wide enough for the slow schema."""
    def make(**fields) -> StructuredOutputs:
        config = StructuredOutputsConfig(**{"compile_timeout": 0.5, "max_bytes": 10**7,
                                            "max_alternatives": 10**6, **fields})
        backend = StructuredOutputs(tiny_model[2], len(tiny_model[2]), None, config)
        made.append(backend)
        return backend

    made: list[StructuredOutputs] = []
    yield make
    for backend in made:
        backend.close()


def test_caps_are_checked_before_compiling_and_name_field_and_flag() -> None:
    config = StructuredOutputsConfig(max_bytes=100, max_alternatives=3)
    nested = {"$defs": {"a": {"anyOf": [{"enum": [1, 2]}, {"type": "null"}]}},
              "oneOf": [{"$ref": "#/$defs/a"}]}
    assert count_alternatives(nested) == 5  # over the whole schema, definitions included
    for spec, flag in [(Spec(json=nested, field="response_format"), "--max-grammar-alternatives"),
                       (Spec(choice=list("abcd"), field="guided_choice"),
                        "--max-grammar-alternatives"),
                       (Spec(regex="x" * 101, field="guided_regex"), "--max-grammar-bytes"),
                       (Spec(json="{" * 50_000, field="guided_json"), "--max-grammar-bytes")]:
        with pytest.raises(RequestError) as info:
            checked_source(spec, config)
        assert info.value.param == spec.field
        assert flag in info.value.message and spec.field in info.value.message
    deep = {}
    for _ in range(5000):  # deeper than Python's stack: an error, never a crash
        deep = {"items": deep}
    with pytest.raises(RequestError, match="nested too deeply"):
        checked_source(Spec(json=deep), StructuredOutputsConfig(max_bytes=10**6))


def test_library_messages_lose_their_source_locations() -> None:
    raw = ("[12:54:35] /project/cpp/json_schema_converter.cc:4939: Check failed: "
           "(error.empty()) is false: Failed to parse JSON: syntax error at line 1\n")
    assert client_message(raw) == "Failed to parse JSON: syntax error at line 1"
    assert len(client_message("x" * 10_000)) < 500


def test_grammar_cache_is_a_bounded_lru(bounded) -> None:
    cache = GrammarCache(2, max_bytes=100)
    a, b, c, d = (GrammarSource(GrammarKind.REGEX, t) for t in "abcd")
    cache.put(a, "A", 10)
    cache.put(b, "B", 10)
    assert cache.get(a) == "A"  # a is now the most recent
    cache.put(c, "C", 10)
    assert b not in cache and a in cache and c in cache
    cache.put(d, "D", 95)  # the byte budget evicts too
    assert len(cache) == 1 and d in cache
    backend = bounded(cache_size=2)
    for regex in ("[a-c]+", "[d-f]+", "[g-i]+"):
        backend.compile(Spec(regex=regex))
    assert len(backend.cache) == 2


def test_a_grammar_over_the_limit_kills_its_worker_and_fails_fast_next_time(bounded) -> None:
    backend = bounded(workers=1)
    backend.compile(Spec(regex="[a-z]+"))  # the worker is up
    start = time.monotonic()
    with pytest.raises(RequestError, match="--grammar-compile-timeout") as info:
        backend.compile(Spec(json=slow_schema("t"), field="guided_json"))
    assert info.value.param == "guided_json"
    assert time.monotonic() - start < 5.0  # the limit, not the ~10 s compilation
    assert backend.pool.killed_workers == 1
    start = time.monotonic()
    with pytest.raises(RequestError, match="--grammar-compile-timeout"):
        backend.compile(Spec(json=slow_schema("t"), field="response_format"))
    assert time.monotonic() - start < 0.5  # the failure is cached
    backend.compile(Spec(regex="[0-9]+"))  # a new worker took over


def test_cancelling_frees_the_worker_and_clients_take_turns(bounded) -> None:
    backend = bounded(workers=1, compile_timeout=60.0)
    backend.compile(Spec(regex="[a-z]+"))
    running = backend.compile_async(Spec(json=slow_schema("run")), client="a")
    queued = backend.compile_async(Spec(json=slow_schema("queued")), client="a")
    time.sleep(0.5)
    assert backend.pool.busy_workers == 1 and backend.pool.queued_jobs == 1
    queued.cancel()
    running.cancel()
    start = time.monotonic()
    backend.compile(Spec(regex="[0-9]+"))
    # a restarted worker (9.5 s once on a loaded 2-core machine), not the two slow
    # compilations (~10 s each) running out
    assert time.monotonic() - start < 16.0
    assert backend.pool.killed_workers == 1 and backend.pool.queued_jobs == 0
    # one worker, busy with client a's first job while a's four others and then client b's
    # one queue: b is not served last
    done: list[str] = []
    first = [backend.compile_async(Spec(json=slow_schema("a0", n=1000)), client="a")]
    first += [backend.compile_async(Spec(regex=f"a{i}[a-z]+"), client="a") for i in range(1, 5)]
    other = backend.compile_async(Spec(regex="b[a-z]+"), client="b")
    assert not first[0].done()  # all queued behind it: the order below is the pool's
    for i, future in enumerate(first):
        future.add_done_callback(lambda _, i=i: done.append(f"a{i}"))
    other.add_done_callback(lambda _: done.append("b"))
    for future in [*first, other]:
        future.result(timeout=30)
    assert done.index("b") <= 2, done  # first come, first served: 5
