"""Structured outputs through HTTP with the embedded SmolLM2: OpenAI's ``response_format``
(the SDK's ``parse()``, streamed and not), vLLM's ``guided_*`` / ``structured_outputs``,
valid outputs at temperature 1 in the same batches as unguided requests, clear 400s."""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"
DATE = r"\d{4}-\d{2}-\d{2}"
COLORS = ["red", "green", "blue", "yellow", "purple"]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Field(max_length=16)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int
    pets: list[Pet] = Field(max_length=3)


NESTED = Person.model_json_schema()


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def chat(server, stream: bool = False, **fields) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion, streamed or not."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a person."}],
            "max_tokens": 200, "stream": stream, **fields}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, reason = "", ""
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason


def is_json_object_prefix(text: str) -> bool:
    """Whether ``text`` can still be completed to a JSON object: the constraint held even
    where ``max_tokens`` cut the output (independent check: a character-level matcher)."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    return xgr.GrammarMatcher(grammar, terminate_without_stop_token=True).accept_string(text)


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    messages = [{"role": "user", "content": "Invent a person with two pets."}]
    reply = client.chat.completions.parse(model=MODEL, messages=messages,
                                          response_format=Person, temperature=1.0, seed=3,
                                          max_tokens=200)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person)
    assert reply.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=Person,
                                        temperature=1.0, seed=3, max_tokens=200) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == person  # same seed, same tokens


@pytest.mark.slow  # every grammar kind at temperature 1 (9 s): make test-fast skips it
def test_every_kind_valid_at_temperature_1_beside_unguided_requests(server) -> None:
    """24 guided requests (6 of each kind, half streamed) and 8 unguided, all at once."""
    kinds = {
        "nested": ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": NESTED, "strict": True}}},
                   lambda t: Person.model_validate_json(t)),
        "json_object": ({"response_format": {"type": "json_object"}, "max_tokens": 400},
                        lambda t: isinstance(json.loads(t), dict) or 1 / 0),
        "regex": ({"guided_regex": DATE}, lambda t: re.fullmatch(DATE, t) or 1 / 0),
        "choice": ({"structured_outputs": {"choice": COLORS}},
                   lambda t: t in COLORS or 1 / 0),
    }
    jobs = [(kind, i) for kind in kinds for i in range(6)] + [("free", i) for i in range(8)]

    def run(job: tuple[str, int]) -> tuple[str, str, str]:
        kind, i = job
        # unguided: 40 tokens whatever the seed samples (EOS ignored), so a grammar that
        # leaked into one would show as an early stop
        fields = kinds[kind][0] if kind != "free" else {"max_tokens": 40, "ignore_eos": True}
        return kind, *chat(server, stream=i % 2 == 1, temperature=1.0, seed=i, **fields)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for kind, text, reason in results:
        if kind == "free":
            assert text and reason == "length"
        elif reason == "length":
            # only a free-form JSON object can run into max_tokens (at temperature 1 a
            # string can go on); what was generated still follows the grammar
            assert kind == "json_object" and is_json_object_prefix(text), (kind, text)
        else:
            assert reason == "stop"
            kinds[kind][1](text)  # raises on an invalid output


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(server, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **fields}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completions_take_constraints_too(server) -> None:
    body = {"model": MODEL, "prompt": "The date today is", "max_tokens": 20,
            "guided_regex": DATE, "temperature": 1.0, "seed": 1}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert re.fullmatch(DATE, resp.json()["choices"][0]["text"])


def test_a_vanishing_temperature_is_raised_not_turned_into_nan(server) -> None:
    """A temperature of 1e-308 (a fuzzer's) divided the logits into inf / NaN, and the
    sampler then drew a token the choice grammar forbids: a 500. It is raised to vLLM's
    floor of 0.01, so the answer is still one of the choices."""
    from server.engine.sampling_params import MIN_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=2.2250738585072014e-308).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy stays greedy
    for seed in range(3):
        text, reason = chat(server, temperature=2.2250738585072014e-308, seed=seed,
                            structured_outputs={"choice": COLORS})
        assert text in COLORS and reason == "stop"
