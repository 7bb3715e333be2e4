"""The official openai SDK against the real server: sync, async, streaming and not."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "the quick brown fox"}]


def test_models_list(client, model_name: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_models_retrieve(client, model_name: str) -> None:
    """GET /v1/models/{id}: the served model's card, or OpenAI's 404 for another id."""
    card = client.models.retrieve(model_name)
    assert card.id == model_name and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="org/other"):
        client.models.retrieve("org/other")


def test_chat_non_streaming_fields(client, model_name: str) -> None:
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=7,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == model_name
    assert resp.created > 0
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7


def test_chat_streaming_equals_non_streaming(client, model_name: str) -> None:
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    # every delta's content is a string, the finish chunk's too (vLLM's clients concatenate
    # them as they come: None + str would raise)
    text = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert text == full
    # a stop string holds the tail back: the finish chunk then carries no text, still ""
    stop = full[len(full) // 2:][:3]
    stopped = list(client.chat.completions.create(stream=True, stop=[stop], **kwargs))
    assert "".join(c.choices[0].delta.content for c in stopped if c.choices) == \
        full[:full.index(stop)]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_n_seed_and_logprobs(client, model_name: str) -> None:
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=11,
                  n=2, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        entries = choice.logprobs.content
        assert len(entries) == 6
        for e in entries:
            assert e.logprob <= 0
            assert len(e.top_logprobs) == 3
            assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
    assert a.usage.completion_tokens == 12


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_n_sends_one_choice_per_chunk(client, model_name: str, endpoint: str) -> None:
    """vLLM streams each of n choices in chunks of their own; the texts equal the whole
    answer's (greedy)."""
    common = dict(model=model_name, max_tokens=5, temperature=0, n=3,
                  extra_body={"ignore_eos": True})
    if endpoint == "chat":
        create, common["messages"] = client.chat.completions.create, MESSAGES
    else:
        create, common["prompt"] = client.completions.create, "the quick"
    whole = create(**common)
    texts = ["", "", ""]
    for chunk in create(stream=True, **common):
        assert len(chunk.choices) == 1, chunk
        choice = chunk.choices[0]
        texts[choice.index] += (choice.delta.content or "") if endpoint == "chat" \
            else choice.text
    expected = [c.message.content if endpoint == "chat" else c.text for c in whole.choices]
    assert texts == expected


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats(client, model_name: str, endpoint: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk says the usage so far, and
    the completion tokens count up to the final usage."""
    common = dict(model=model_name, max_tokens=6, temperature=0, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                  extra_body={"ignore_eos": True})
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **common))
    else:
        chunks = list(client.completions.create(prompt="the quick", **common))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    plain = dict(common, stream_options={"include_usage": True})
    plain_chunks = list(client.chat.completions.create(messages=MESSAGES, **plain)
                        if endpoint == "chat" else
                        client.completions.create(prompt="the quick", **plain))
    assert [c.usage is not None for c in plain_chunks].count(True) == 1  # the last only


def _detokenize(server, ids: list[int]) -> str:
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids},
                      timeout=30).json()["prompt"]


def test_return_token_ids(server, client, model_name: str) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's, whole and streamed (the
    prompt's in the first chunk only), decoding to the prompt and to the text."""
    common = dict(model=model_name, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    chat = client.chat.completions.create(messages=MESSAGES, **common).model_dump()
    assert "the quick brown fox" in _detokenize(server, chat["prompt_token_ids"])
    ids = chat["choices"][0]["token_ids"]
    assert len(ids) == 6 and _detokenize(server, ids) == chat["choices"][0]["message"]["content"]
    chunks = [c.model_dump() for c in client.chat.completions.create(
        messages=MESSAGES, stream=True, **common)]
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == ids

    text = client.completions.create(prompt="the quick", **common).model_dump()
    choice = text["choices"][0]
    assert _detokenize(server, choice["prompt_token_ids"]).endswith("the quick")
    assert _detokenize(server, choice["token_ids"]) == choice["text"]
    streamed = [c.model_dump()["choices"][0] for c in client.completions.create(
        prompt="the quick", stream=True, **common)]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in streamed[1:])
    assert sum((c["token_ids"] for c in streamed), []) == choice["token_ids"]
    plain = client.completions.create(model=model_name, prompt="the quick", max_tokens=2)
    assert plain.choices[0].model_dump().get("token_ids") is None


def test_continue_final_message(server, client, model_name: str) -> None:
    """vLLM's continue_final_message: the last (assistant) message stays open, so the
    prompt ends with its text, not with an end of turn or a new turn."""
    saying = "An apple a day keeps"
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": saying}]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True, "ignore_eos": True})
    open_ids = reply.model_dump()["prompt_token_ids"]
    prompt = _detokenize(server, open_ids)
    assert prompt.endswith(saying) and prompt.count(saying) == 1
    closed = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=1, temperature=0,
        extra_body={"add_generation_prompt": False, "return_token_ids": True})
    # without it the turn is closed: the same ids, then the end-of-turn token(s)
    closed_ids = closed.model_dump()["prompt_token_ids"]
    assert len(closed_ids) > len(open_ids) and closed_ids[:len(open_ids)] == open_ids
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})


def test_completions_batch_echo_stop_and_logprobs(client, model_name: str) -> None:
    resp = client.completions.create(model=model_name, prompt=["the quick", "numbers 1 2"],
                                     max_tokens=5, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text  # greedy: both completions agree
    assert resp.usage.completion_tokens == 20
    echo = client.completions.create(model=model_name, prompt="the quick", max_tokens=3,
                                     temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echo.choices[0].text.startswith("the quick")
    lp = client.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=4,
                                   temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 4
    assert len(logprobs.token_logprobs) == 4
    # the sampled token is always among them (OpenAI: up to logprobs + 1 entries; tokens
    # that decode alike, such as partial UTF-8 bytes, share a key)
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
        assert token in top and len(top) <= 3
    assert logprobs.text_offset[0] == 0
    zero = client.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=3,
                                     temperature=1.0, seed=3, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [list(top) for top in zero.top_logprobs] == [[t] for t in zero.tokens]
    ids = client.completions.create(model=model_name, prompt="the quick", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True,
                                                               "stop_token_ids": [2]})
    assert ids.choices[0].finish_reason in ("length", "stop")


def test_async_client_concurrent_streams(server, model_name: str) -> None:
    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x")

        async def one(i: int) -> str:
            stream = await aclient.completions.create(
                model=model_name, prompt=f"numbers {i}", max_tokens=8, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(i % 4) for i in range(8)))

    texts = asyncio.run(main())
    assert texts[:4] == texts[4:]


def test_sdk_raises_typed_errors(client, model_name: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=-1)
    assert "temperature" in str(err.value)


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client, model_name: str) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are served, even when the
    whole prompt is longer than the context (the length check applies after truncating)."""
    ids = [5 + i % 40 for i in range(600)]  # longer than the context
    reply = client.completions.create(
        model=model_name, prompt=ids, max_tokens=2, temperature=0,
        extra_body={"truncate_prompt_tokens": 10, "return_token_ids": True})
    assert reply.usage.prompt_tokens == 10
    assert reply.choices[0].model_dump()["prompt_token_ids"] == ids[-10:]
    text = "the quick brown fox " * 400  # refused unread without truncation
    reply = client.completions.create(model=model_name, prompt=text, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": 20})
    assert reply.usage.prompt_tokens == 20
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model_name, prompt=text, max_tokens=2)
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": text}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": -1})
    assert chat.usage.prompt_tokens == server_max_len(server) - 2  # beside max_tokens


def server_max_len(server) -> int:
    return httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0][
        "max_model_len"]


def test_allowed_token_ids_limit_what_is_sampled(client, model_name: str) -> None:
    """vLLM's allowed_token_ids: every sampled token is one of them, at any temperature, and
    the logprobs are over them alone."""
    allowed = [5, 9, 17]
    for seed in range(3):
        reply = client.completions.create(
            model=model_name, prompt="the quick", max_tokens=8, temperature=1.5, seed=seed,
            logprobs=2, extra_body={"allowed_token_ids": allowed, "return_token_ids": True,
                                    "ignore_eos": True})
        choice = reply.choices[0].model_dump()
        assert set(choice["token_ids"]) <= set(allowed), choice["token_ids"]
        assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model=model_name, prompt="x", max_tokens=1,
                                  extra_body={"allowed_token_ids": [10**8]})
    # with a grammar the two masks could leave nothing to sample (found by the fuzz run)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model=model_name, prompt="x", max_tokens=1,
                                  extra_body={"allowed_token_ids": [5],
                                              "guided_choice": ["yes", "no"]})
    # min_tokens forbids EOS; allowed only EOS: the allowed token still wins
    eos = client.completions.create(model=model_name, prompt="x", max_tokens=2,
                                    extra_body={"allowed_token_ids": [2], "min_tokens": 2,
                                                "return_token_ids": True})
    assert set(eos.choices[0].model_dump()["token_ids"]) <= {2}


def test_return_tokens_as_token_ids(client, model_name: str) -> None:
    """vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:N", N the sampled
    ids (return_token_ids), whole and streamed, chat and completions."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True}
    text = client.completions.create(model=model_name, prompt="the quick", max_tokens=4,
                                     temperature=0, logprobs=1, extra_body=extra)
    choice = text.choices[0].model_dump()
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body=extra)
    entries = chat.choices[0].logprobs.content
    ids = chat.choices[0].model_dump()["token_ids"]
    assert [e.token for e in entries] == [f"token_id:{t}" for t in ids]
    streamed = [c for c in client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        stream=True, extra_body=extra) if c.choices and c.choices[0].logprobs]
    assert [e.token for c in streamed for e in c.choices[0].logprobs.content] == \
        [f"token_id:{t}" for t in ids]
