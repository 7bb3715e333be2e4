"""Logprobs on /v1/responses (``include: ["message.output_text.logprobs"]`` with
``top_logprobs``), through the openai SDK on a real server with the tiny random Llama: the
values are transformers' log-softmax of the same tokens; streamed, each text delta carries
its tokens' logprobs and together they are the whole answer's."""

from __future__ import annotations

import openai
import pytest
import torch
from server_process import MODEL_NAME, TINY_FLAGS, start_server

pytestmark = pytest.mark.slow  # a server of its own

INCLUDE = ["message.output_text.logprobs"]
ASK = dict(model=MODEL_NAME, input="the quick brown fox", max_output_tokens=8,
           temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS)
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def reference(tiny_model, steps: int) -> list[torch.Tensor]:
    """transformers' log-softmax at each greedy step of the chat prompt's continuation."""
    _, model, tokenizer = tiny_model
    ids = tokenizer.apply_chat_template([{"role": "user", "content": ASK["input"]}],
                                        add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(ids, add_special_tokens=False)
    rows = []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            rows.append(row)
            ids.append(int(row.argmax()))
    return rows


def test_whole_answer_logprobs_match_transformers(client, tiny_model) -> None:
    answer = client.responses.create(include=INCLUDE, top_logprobs=3, **ASK)
    part = answer.output[-1].content[-1]
    assert len(part.logprobs) == 8
    for entry, row in zip(part.logprobs, reference(tiny_model, 8)):
        top = row.topk(3)
        assert abs(entry.logprob - float(top.values[0])) < 1e-4  # greedy: the best token
        assert [round(t.logprob, 4) for t in entry.top_logprobs] == \
            [round(float(v), 4) for v in top.values]
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode("utf-8"))
    # without the include there are none, as in vLLM (top_logprobs alone asks nothing)
    plain = client.responses.create(top_logprobs=3, **ASK)
    assert plain.output[-1].content[-1].logprobs == []
    assert plain.output_text == answer.output_text


def test_streamed_deltas_carry_their_tokens_logprobs(client) -> None:
    whole = client.responses.create(include=INCLUDE, top_logprobs=2, **ASK)
    events = list(client.responses.create(include=INCLUDE, top_logprobs=2, stream=True,
                                          **ASK))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs for e in deltas)
    streamed = [(lp.token, lp.logprob, [t.logprob for t in lp.top_logprobs])
                for e in deltas for lp in e.logprobs]
    expected = [(lp.token, lp.logprob, [t.logprob for t in lp.top_logprobs])
                for lp in whole.output[-1].content[-1].logprobs]
    assert streamed == expected
    done = next(e for e in events if e.type == "response.output_text.done")
    assert len(done.logprobs) == 8
    final = events[-1].response.output[-1].content[-1]
    assert len(final.logprobs) == 8


def test_top_logprobs_over_20_and_other_includes_are_400(client) -> None:
    with pytest.raises(openai.BadRequestError):
        client.responses.create(include=INCLUDE, top_logprobs=21, **ASK)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(include=["reasoning.encrypted_content"], **ASK)
    assert refused.value.body["param"] == "include"
