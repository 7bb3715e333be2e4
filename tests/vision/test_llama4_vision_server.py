"""Llama 4 vision through the real HTTP server and the official openai SDK: answers equal
transformers' greedy text for images of several sizes and aspect ratios (1 to 4 tiles and
a thumbnail), one and two per message; the encoder cache's hits on /metrics; and the
``buckets`` command's tiles-per-call encoder plan."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from llama4_vision_helpers import reference
from vision_helpers import data_uri, random_image

MAX_TOKENS = 8


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(client: openai.OpenAI, content: list[dict]) -> str:
    resp = client.chat.completions.create(
        model="tiny-llama4v", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return resp.choices[0].message.content


def _expected(tiny_llama4v, content: list[dict]) -> str:
    """transformers' answer to the same message, its images decoded as the server decodes
    them, tiled by the same processor settings."""
    from PIL import Image

    from server.engine.multimodal.tile_processor import TiledImageProcessor
    from server.models.loader import ModelSource, load_vision_config

    folder, model, tokenizer = tiny_llama4v
    images = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
              .convert("RGB") for p in content if p["type"] == "image_url"]
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    tiles = TiledImageProcessor(folder, load_vision_config(ModelSource(folder, None, "l4")),
                                2)(images)
    ids = reference(model, tokenizer, text, tiles["pixel_values"], tiles["aspect_ratios"],
                    MAX_TOKENS)[1]
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow  # a server start and five references (~30 s on two shared cores)
def test_sdk_answers_equal_transformers(tiny_llama4v, start_server_fn) -> None:
    srv = start_server_fn(tiny_llama4v[0], "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager", "--max-model-len", "512",
                          "--served-model-name", "tiny-llama4v",
                          "--limit-mm-per-prompt", '{"image": 2}')
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        wide, tall, square = (random_image(90, 40, 1), random_image(25, 80, 2),
                              random_image(33, 33, 3))
        messages = [
            [_part(data_uri(wide)), {"type": "text", "text": "the quick brown fox"}],
            [{"type": "text", "text": "the lazy dog"}, _part(data_uri(tall, "JPEG")),
             {"type": "text", "text": "and"}, _part(data_uri(square))],
            [{"type": "text", "text": "paged attention stores keys and values"},
             _part(data_uri(random_image(300, 200, 4)))],
            [_part(data_uri(square)), _part(data_uri(random_image(12, 9, 5)))],
        ]
        for content in messages:
            assert _chat(client, content) == _expected(tiny_llama4v, content)
        # the square (one tile) again: found in the encoder cache
        assert srv.metric("hpu_serve:encoder_cache_hits_total") >= 1
        with pytest.raises(openai.BadRequestError, match="at most 2 images"):
            _chat(client, [_part(data_uri(square))] * 3)
    finally:
        srv.stop()


def test_buckets_command_prints_tiles_per_call(tiny_llama4v, capsys) -> None:
    """``hpu-serve buckets MODEL``: an image is up to 4 tiles and a thumbnail (2 images a
    prompt, 4 prompts a step: 40 tiles, whose 640 rows the step's token budget holds)."""
    from server.cli import main

    assert main(["buckets", tiny_llama4v[0], "--max-model-len", "512", "--max-num-seqs", "4",
                 "--limit-mm-per-prompt", '{"image": 2}']) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("Generated 7 encoder buckets [tiles, patches] (3x32x32 pixels per tile): "
                    "[(1, 64), (2, 64), (4, 64), (8, 64), (16, 64), (32, 64), (40, 64)]")
    assert main(["buckets", tiny_llama4v[0], "--max-model-len", "512", "--max-num-seqs", "4",
                 "--limit-mm-per-prompt", '{"image": 1}',
                 "--mm-processor-kwargs", '{"max_patches": 2}']) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith("[(1, 64), (2, 64), (4, 64), (8, 64), (12, 64)]")
