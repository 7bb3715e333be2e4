"""Images through Anthropic's Messages API and OpenAI's Responses API, with their official
SDKs against the real HTTP server: the tiny LLaVA's answer equals chat completions' and
transformers' greedy text for the same prompt, and a bad image is a 400 in the API's own
error shape naming the field and the problem."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
from vision_helpers import data_uri, random_image, reference_ids

MAX_TOKENS = 8
GREEDY = {"temperature": 0.0}  # the anthropic SDK's create() has no temperature argument
pytestmark = pytest.mark.slow  # a server start and a few references (~30 s on two cores)


@pytest.fixture(scope="module")
def server(tiny_llava, start_server_fn, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    random_image(48, 64, seed=7).save(media / "local.png")
    srv = start_server_fn(tiny_llava[0], "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager", "--max-model-len", "256",
                          "--served-model-name", "tiny-llava",
                          "--limit-mm-per-prompt", '{"image": 2}',
                          "--allowed-local-media-path", str(media))
    srv.media = media
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _b64(image, fmt: str = "PNG") -> str:
    return data_uri(image, fmt).split(",", 1)[1]


def _decoded(uri: str):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def _expected(tiny_llava, messages: list[dict], images: list) -> str:
    """transformers' greedy text for chat-shaped ``messages`` (image parts as
    ``{"type": "image"}``)."""
    _, model, processor = tiny_llava
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = reference_ids(model, processor, text, images, MAX_TOKENS)
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


def _chat(oai: openai.OpenAI, content: list[dict]) -> str:
    resp = oai.chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return resp.choices[0].message.content


def test_messages_api_images_answer_as_chat_and_transformers(server, claude, oai,
                                                             tiny_llava) -> None:
    wide, square = random_image(90, 40, 11), random_image(33, 33, 12)
    local = server.media / "local.png"
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": _b64(wide)}},
        {"type": "text", "text": "the quick brown fox"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": _b64(square, "JPEG")}},
    ]
    reply = claude.messages.create(model="tiny-llava", max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": content}])
    assert reply.stop_reason == "max_tokens"  # no end of sequence: the whole 8 tokens
    answer = reply.content[0].text
    jpeg = _decoded(data_uri(square, "JPEG"))  # decoded as the server decodes it
    chat_parts = [{"type": "image_url", "image_url": {"url": data_uri(wide)}},
                  {"type": "text", "text": "the quick brown fox"},
                  {"type": "image_url", "image_url": {"url": data_uri(square, "JPEG")}}]
    assert answer == _chat(oai, chat_parts)
    expected = _expected(tiny_llava, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "the quick brown fox"},
        {"type": "image"}]}], [wide, jpeg])
    assert answer == expected
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 2 * 25
    # a url source (a file under --allowed-local-media-path), streamed
    from PIL import Image

    url_content = [{"type": "text", "text": "numbers"},
                   {"type": "image", "source": {"type": "url", "url": local.as_uri()}}]
    with claude.messages.stream(model="tiny-llava", max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                messages=[{"role": "user", "content": url_content}]) as s:
        streamed = s.get_final_text()
    assert streamed == _expected(tiny_llava, [{"role": "user", "content": [
        {"type": "text", "text": "numbers"}, {"type": "image"}]}],
        [Image.open(local).convert("RGB")])


def test_messages_api_bad_images_are_anthropic_400s(server, claude) -> None:
    def block(source: dict) -> dict:
        return {"type": "image", "source": source}

    png = {"type": "base64", "media_type": "image/png", "data": _b64(random_image(8, 8, 1))}
    cases = [
        ([block({"type": "base64", "media_type": "image/png",
                 "data": base64.b64encode(b"not an image" * 40).decode()})],
         ["messages.0.content.0.source.data", "not a PNG, JPEG or WebP"]),
        ([block({"type": "base64", "media_type": "image/gif", "data": "R0lGODlhAQABAAAAACw="})],
         ["messages.0.content.0.source.data", "unsupported image type 'image/gif'"]),
        ([{"type": "text", "text": "hi"}, block({"type": "url", "url": "file:///etc/passwd"})],
         ["messages.0.content.1.source.url", "outside --allowed-local-media-path"]),
        ([block({"type": "file", "file_id": "file_011"})],
         ["messages.0.content.0.source.file_id", "Files API"]),
        ([block(png)] * 3, ["messages.0.content.2.source.data", "at most 2 images"]),
    ]
    for content, words in cases:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model="tiny-llava", max_tokens=4,
                                   messages=[{"role": "user", "content": content}])
        body = info.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        for word in words:
            assert word in body["error"]["message"], (word, body)
    # an image in the assistant's turn is refused by its block's path
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny-llava", max_tokens=4, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [block(png)]}])
    assert "messages.1.content.0" in info.value.body["error"]["message"]
    # count_tokens cannot count an image's tokens: said, not miscounted
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.count_tokens(model="tiny-llava", messages=[
            {"role": "user", "content": [block(png)]}])
    assert "count_tokens does not count image blocks" in info.value.body["error"]["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_responses_api_input_image_answers_as_transformers(server, oai, tiny_llava) -> None:
    tall = random_image(25, 80, 21)
    content = [{"type": "input_text", "text": "the lazy dog"},
               {"type": "input_image", "image_url": data_uri(tall), "detail": "high"}]
    first = oai.responses.create(model="tiny-llava", max_output_tokens=MAX_TOKENS,
                                 temperature=0, input=[{"role": "user", "content": content}],
                                 extra_body={"ignore_eos": True})
    asked = [{"role": "user", "content": [{"type": "text", "text": "the lazy dog"},
                                          {"type": "image"}]}]
    assert first.output_text == _expected(tiny_llava, asked, [tall])
    assert first.output_text == _chat(oai, [
        {"type": "text", "text": "the lazy dog"},
        {"type": "image_url", "image_url": {"url": data_uri(tall)}}])
    # the next turn continues a conversation that holds the image
    second = oai.responses.create(model="tiny-llava", max_output_tokens=MAX_TOKENS,
                                  temperature=0, input="and the fox",
                                  previous_response_id=first.id,
                                  extra_body={"ignore_eos": True})
    history = asked + [{"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": "and the fox"}]
    assert second.output_text == _expected(tiny_llava, history, [tall])


@pytest.mark.parametrize("part, param, words", [
    ({"type": "input_image", "file_id": "file-abc"}, "input[0].content[1].file_id",
     "Files API"),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
     "input[0].content[1].image_url", "not a PNG, JPEG or WebP"),
    ({"type": "input_image"}, "input[0].content[1].image_url", "needs image_url"),
    ({"type": "input_image", "image_url": "x", "detail": "ultra"},
     "input.0.message.content.1.detail", "'auto', 'low' or 'high'"),
])
def test_responses_api_bad_images_are_400s_naming_them(server, oai, part: dict, param: str,
                                                       words: str) -> None:
    content = [{"type": "input_text", "text": "what is it?"}, part]
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="tiny-llava", max_output_tokens=4,
                             input=[{"role": "user", "content": content}])
    assert words in info.value.message, info.value.body
    assert info.value.body["param"].startswith(param), info.value.body
