"""vLLM's request extras end to end through the real server and the OpenAI SDK:
prompt_logprobs (completions and chat, vLLM's shape, against transformers), echo with
logprobs (max_tokens 0 included, streamed too), chat echo, bad_words, and the refusals."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_process import MODEL_NAME

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_on_completions_match_transformers(server, tiny_model) -> None:
    hf_model = tiny_model[1]
    ids = [5, 17, 42, 99, 7, 250, 31]
    body = post(server, COMPLETIONS, prompt=ids, max_tokens=2, prompt_logprobs=2,
                temperature=0).json()
    choice = body["choices"][0]
    scored = choice["prompt_logprobs"]
    want = reference(hf_model, ids)
    assert len(scored) == len(ids) and scored[0] is None
    for pos, entry in enumerate(scored[1:], start=1):
        row = want[pos - 1]
        own = entry[str(ids[pos])]
        assert own["logprob"] == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        assert own["rank"] == int((row > row[ids[pos]]).sum()) + 1
        assert isinstance(own["decoded_token"], str)
        top = row.topk(2).indices.tolist()
        assert all(str(t) in entry for t in top)
        assert {entry[str(t)]["rank"] for t in top} <= {1, 2, own["rank"]}
        assert len(entry) in (2, 3)
    # not asked: null, on the choice (completions) as vLLM answers
    plain = post(server, COMPLETIONS, prompt=ids, max_tokens=2).json()
    assert "prompt_logprobs" in plain["choices"][0]
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_on_chat_are_the_responses(server, client, model_name) -> None:
    resp = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "hi there"}], max_tokens=2,
        extra_body={"prompt_logprobs": 1})
    scored = resp.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) > 2
    assert all(1 <= len(e) <= 2 for e in scored[1:])
    plain = post(server, CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert plain.json()["prompt_logprobs"] is None
    assert "prompt_logprobs" not in plain.json()["choices"][0]


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1,
            "stream": True}),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -2}),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}),  # the vocabulary > --max-logprobs
])
def test_prompt_logprobs_limits_are_400s(server, path: str, body: dict) -> None:
    resp = post(server, path, **body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs(client, model_name, server) -> None:
    ids = [5, 17, 42, 99]
    resp = client.completions.create(model=model_name, prompt=ids, max_tokens=3,
                                     temperature=0, echo=True, logprobs=1,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=model_name, prompt=ids, max_tokens=3,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    scored = resp.model_extra.get("prompt_logprobs") or \
        resp.choices[0].model_extra["prompt_logprobs"]
    assert [e[str(t)]["logprob"] for e, t in zip(scored[1:], ids[1:])] == \
        pytest.approx(lp.token_logprobs[1:len(ids)])
    # max_tokens 0: the prompt alone
    only = client.completions.create(model=model_name, prompt="the quick brown", max_tokens=0,
                                     echo=True, logprobs=0)
    assert only.choices[0].text == "the quick brown"
    assert only.choices[0].logprobs.token_logprobs[0] is None
    assert len(only.choices[0].logprobs.tokens) == len(
        post(server, "/tokenize", prompt="the quick brown").json()["tokens"])
    assert post(server, COMPLETIONS, prompt="x", max_tokens=0).status_code == 400
    # streamed: the first chunk carries the prompt's tokens
    chunks = list(client.completions.create(model=model_name, prompt=ids, max_tokens=3,
                                            temperature=0, echo=True, logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_chat_echo_prepends_the_last_message(client, model_name) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Sure, "}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    resp = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3,
                                          temperature=0, extra_body=extra)
    plain = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=3, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert resp.choices[0].message.content == "Sure, " + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model_name, messages=messages,
                                                 max_tokens=3, temperature=0, stream=True,
                                                 extra_body=extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    # the last message is the user's: nothing to echo
    user = client.chat.completions.create(model=model_name, messages=messages[:1],
                                          max_tokens=3, temperature=0,
                                          extra_body={"echo": True})
    assert not user.choices[0].message.content.startswith("hi")


def test_bad_words_remove_a_greedy_word(server) -> None:
    base = {"prompt": "numbers 1 2", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    greedy = post(server, COMPLETIONS, **base).json()["choices"][0]
    ids = greedy["token_ids"]
    word_id = ids[3]
    word = post(server, "/detokenize", tokens=[word_id]).json()["prompt"]
    banned = post(server, COMPLETIONS, **base, bad_words=[word]).json()["choices"][0]
    assert word_id not in banned["token_ids"]
    # identical up to the banned word's first appearance
    first = ids.index(word_id)
    assert banned["token_ids"][:first] == ids[:first]
    assert banned["token_ids"][first] != word_id
