"""Wording vLLM's own tests check (found by test_chat.py::test_long_seed): a field outside
its range is a 400 naming the field and carrying pydantic's error tag, as vLLM's messages
do ("greater_than_equal", "less_than_equal")."""

from __future__ import annotations

import openai
import pytest


@pytest.mark.parametrize(("seed", "tag"), [(-(2**63) - 1, "greater_than_equal"),
                                           (2**63, "less_than_equal")])
def test_out_of_range_seed_names_the_field_and_the_constraint(client, model_name, seed,
                                                              tag) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, seed=seed, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 400
    assert f"[type={tag}]" in exc.value.message
    assert exc.value.body["param"] == "seed"
