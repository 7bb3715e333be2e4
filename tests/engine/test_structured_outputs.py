"""Structured outputs in the engine: grammars compiled per request, a token mask per step,
guided and unguided requests in the same batches."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from server import LLM, SamplingParams
from server.engine.errors import RequestError
from server.engine.sampling_params import StructuredOutputsParams as Spec
from server.engine.structured_outputs import GrammarState, apply_bitmask

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
