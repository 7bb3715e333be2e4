"""``use_beam_search`` on /v1/completions and /v1/chat/completions through the openai SDK on
a real server (the tiny random Llama): the choices are transformers' ``num_beams`` beams,
best first, token for token; streamed they arrive whole; what beam search cannot honour is
a 400 naming it."""

from __future__ import annotations

import openai
import pytest
import torch
from server_process import MODEL_NAME, TINY_FLAGS, start_server

pytestmark = pytest.mark.slow  # a server of its own

BEAMS = {"use_beam_search": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_model):
    srv = start_server(tiny_model[0], *TINY_FLAGS)
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def hf_texts(tiny_model, prompt: list[int], width: int, new_tokens: int) -> list[str]:
    _, model, tokenizer = tiny_model
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, early_stopping=False)
    return [tokenizer.decode(seq[len(prompt):]) for seq in out]


def test_completion_beams_are_transformers(client, tiny_model) -> None:
    prompt = tiny_model[2].encode("the quick brown fox")
    answer = client.completions.create(model=MODEL_NAME, prompt=[prompt, prompt], n=3,
                                       max_tokens=6, temperature=0.0, extra_body=BEAMS)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    expected = hf_texts(tiny_model, prompt, 3, 6)
    assert texts == expected + expected  # two copies of the prompt, each its beams
    assert answer.usage.completion_tokens == 2 * 3 * 6
    streamed = client.completions.create(model=MODEL_NAME, prompt=prompt, n=3, max_tokens=6,
                                         temperature=0.0, stream=True, extra_body=BEAMS)
    got = {}
    for chunk in streamed:
        for choice in chunk.choices:
            got[choice.index] = got.get(choice.index, "") + choice.text
    assert [got[i] for i in range(3)] == expected


def test_chat_beams_are_transformers(client, tiny_model) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    prompt = tiny_model[2].encode(tiny_model[2].apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2,
                                            max_tokens=5, extra_body=BEAMS, logprobs=True,
                                            top_logprobs=2)
    expected = hf_texts(tiny_model, prompt, 2, 5)
    assert [c.message.content for c in answer.choices] == expected
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2,
                                              max_tokens=5, extra_body=BEAMS, stream=True)
    got: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
    assert [got[0], got[1]] == expected
    assert all(len(c.logprobs.content) == 5 for c in answer.choices)
    assert all(len(e.top_logprobs) == 2 for c in answer.choices for e in c.logprobs.content)


@pytest.mark.parametrize("extra, param", [
    ({"stop": ["x"]}, "stop"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"seed": 3}, "seed"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 11}, "n"),
])
def test_what_beams_cannot_honour_is_400(client, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, **BEAMS, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/chat/completions", body=body, cast_to=object)
    assert refused.value.body["param"] == param, refused.value.body
