"""Arbitrary constraints from clients go to a native grammar compiler: whatever they are,
the answer is a 200 or a 400, never a 5xx, and the engine stays up."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import MODEL_NAME

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required",
                                       "minItems", "maxLength", "pattern", "$ref", "anyOf",
                                       "additionalProperties", "x"]), children, max_size=4),
    max_leaves=12,
)
SCHEMA_TYPES = st.sampled_from(["object", "array", "string", "integer", "number", "boolean",
                                "null", "nope"])
SCHEMAS = st.fixed_dictionaries({"type": SCHEMA_TYPES}, optional={
    "properties": st.dictionaries(st.text(max_size=6), JSON, max_size=3),
    "items": JSON, "enum": st.lists(JSON, max_size=3), "required": st.lists(st.text(max_size=4)),
    "pattern": st.text(max_size=12), "minItems": st.integers(-2, 5)})
CONSTRAINTS = st.one_of(
    st.builds(lambda s: {"guided_json": s}, SCHEMAS),
    st.builds(lambda s: {"guided_regex": s}, st.text(max_size=24)),
    st.builds(lambda s: {"guided_grammar": s}, st.text(max_size=40)),
    st.builds(lambda s: {"guided_grammar": "root ::= " + s}, st.text(max_size=30)),
    st.builds(lambda c: {"guided_choice": c}, st.lists(st.text(max_size=6), max_size=4)),
    st.builds(lambda s: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": s}}}, SCHEMAS),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(constraint=CONSTRAINTS, chat=st.booleans())
def _fuzz(server, constraint: dict, chat: bool) -> None:
    base = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = httpx.post(server.base_url + path, timeout=60, json={
        "model": MODEL_NAME, "max_tokens": 4, **base, **constraint})
    assert resp.status_code in (200, 400), (constraint, resp.status_code, resp.text)
    if resp.status_code == 400:
        assert resp.json()["error"]["param"], resp.text


def test_random_constraints_never_answer_5xx(server) -> None:
    _fuzz(server)
    assert httpx.get(server.base_url + "/health").status_code == 200
    # the server still serves a valid constraint afterwards
    resp = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "x", "max_tokens": 8, "guided_choice": ["yes", "no"]})
    assert resp.json()["choices"][0]["text"] in ("yes", "no")


pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
