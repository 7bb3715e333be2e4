"""Gemma 3 through the real HTTP server and the official openai SDK: answers equal
transformers' greedy text for images of several sizes and aspect ratios, one and two per
message (PNG and JPEG), in eager mode and in compile mode, where a randomized sweep of image
sizes compiles nothing and misses no bucket while serving."""

from __future__ import annotations

import base64
import io
import random

import httpx
import openai
import pytest
from vision_helpers import data_uri, random_image, reference_ids

MAX_TOKENS = 8


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(client: openai.OpenAI, content: list[dict]) -> str:
    resp = client.chat.completions.create(
        model="tiny-gemma3", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return resp.choices[0].message.content


def _expected(tiny_gemma3, content: list[dict]) -> str:
    """transformers' answer to the same message, its images decoded as the server decodes
    them (a JPEG's pixels are not the original's)."""
    from PIL import Image

    _, model, processor = tiny_gemma3
    images = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
              .convert("RGB") for p in content if p["type"] == "image_url"]
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True)
    ids = reference_ids(model, processor, text, images, MAX_TOKENS)
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


def _metric_lines(base_url: str, prefix: str) -> list[str]:
    return [line for line in httpx.get(base_url + "/metrics").text.splitlines()
            if line.startswith(prefix)]


@pytest.mark.slow  # a server start and five references (~30 s on two shared cores)
def test_sdk_answers_equal_transformers(tiny_gemma3, start_server_fn) -> None:
    srv = start_server_fn(tiny_gemma3[0], "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager", "--max-model-len", "256",
                          "--served-model-name", "tiny-gemma3",
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
            assert _chat(client, content) == _expected(tiny_gemma3, content)
        hits = _metric_lines(srv.base_url, "hpu_serve:encoder_cache_hits_total")
        assert hits and float(hits[0].split()[-1]) >= 1, hits  # the square, again
    finally:
        srv.stop()


@pytest.mark.slow  # compiles 5 buckets before the port opens (1.5-8 min on two cores)
def test_compile_mode_through_the_sdk_compiles_nothing_while_serving(
        tiny_gemma3, start_server_fn, tmp_path) -> None:
    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(1, [96], 0)\n"
                       "# decode buckets\n([2], 1, [32])\n")
    srv = start_server_fn(tiny_gemma3[0], "--dtype", "float32", "--block-size", "8",
                          "--execution-mode", "compile", "--max-model-len", "128",
                          "--max-num-seqs", "2", "--served-model-name", "tiny-gemma3",
                          "--limit-mm-per-prompt", '{"image": 2}',
                          env={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        rng = random.Random(1)
        for i in range(6):
            images = [random_image(rng.randint(8, 300), rng.randint(8, 300), 300 + 2 * i + k)
                      for k in range(rng.choice([1, 2]))]
            content = [_part(data_uri(image)) for image in images]
            content.append({"type": "text", "text": "the fox"})
            assert _chat(client, content) == _expected(tiny_gemma3, content)
        serving = [line for line in _metric_lines(srv.base_url,
                                                  "hpu_serve:graph_compilations_total")
                   if 'stage="serving"' in line]
        assert serving and all(float(line.split()[-1]) == 0 for line in serving), serving
        encoder = [line for line in _metric_lines(srv.base_url,
                                                  "hpu_serve:graph_compilations_total")
                   if 'phase="encoder"' in line and 'stage="warmup"' in line]
        assert float(encoder[0].split()[-1]) == 3  # the buckets of 1, 2 and 4 images
        misses = _metric_lines(srv.base_url, "hpu_serve:bucket_misses_total")
        assert misses and all(float(line.split()[-1]) == 0 for line in misses), misses
    finally:
        srv.stop()
