"""Qwen2.5-VL through the real HTTP server and the official openai SDK: the tiny model's
answers equal transformers' greedy text for images of several sizes and aspect ratios (one
and two per message, PNG and JPEG), in eager mode and in compile mode, where a randomized
sweep of image sizes within --mm-processor-kwargs' bounds compiles nothing while serving."""

from __future__ import annotations

import base64
import io
import random

import httpx
import openai
import pytest
from vision_helpers import data_uri, random_image

MAX_TOKENS = 8


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(client: openai.OpenAI, content: list[dict]) -> str:
    resp = client.chat.completions.create(
        model="tiny-qwen", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return resp.choices[0].message.content


def _expected(ref, content: list[dict], images: list) -> str:
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = ref.tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                             add_generation_prompt=True, tokenize=False)
    return ref.text(text, images, MAX_TOKENS)


def _decoded(part: dict):
    from PIL import Image

    data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    return Image.open(io.BytesIO(data)).convert("RGB")


def _metric(text: str, name: str, *labels: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(name) and all(label in line for label in labels)]


@pytest.mark.slow  # a server start and a few references (~30 s on two shared cores)
def test_sdk_answers_equal_transformers(tiny_qwen25vl, start_server_fn) -> None:
    folder, ref = tiny_qwen25vl
    srv = start_server_fn(folder, "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager", "--max-model-len", "256",
                          "--served-model-name", "tiny-qwen",
                          "--limit-mm-per-prompt", '{"image": 2}')
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        wide, tall, square = (random_image(90, 40, 1), random_image(25, 80, 2),
                              random_image(64, 64, 3))
        one = [_part(data_uri(wide)), {"type": "text", "text": "the quick brown fox"}]
        assert _chat(client, one) == _expected(ref, one, [wide])
        two = [{"type": "text", "text": "the lazy dog"}, _part(data_uri(tall, "JPEG")),
               {"type": "text", "text": "and"}, _part(data_uri(square))]
        assert _chat(client, two) == _expected(ref, two, [_decoded(p) for p in two[1::2]])
        text_only = [{"type": "text", "text": "numbers 0 1 2"}]
        assert _chat(client, text_only) == _expected(ref, text_only, [])
        again = [{"type": "text", "text": "paged attention"}, _part(data_uri(wide))]
        assert _chat(client, again) == _expected(ref, again, [wide])
        metrics = httpx.get(srv.base_url + "/metrics").text
        hits = _metric(metrics, "hpu_serve:encoder_cache_hits_total")
        assert hits and hits[0] >= 1, hits
    finally:
        srv.stop()


@pytest.mark.slow  # compiles every bucket before the port opens (~4 min on two cores)
def test_compile_mode_through_the_sdk_compiles_nothing_while_serving(
        tiny_qwen25vl, start_server_fn, tmp_path) -> None:
    folder, ref = tiny_qwen25vl
    buckets = tmp_path / "buckets.txt"
    # (1, 96, 1): the prompts share their first block (the chat prefix before the image)
    buckets.write_text("# prompt buckets\n(1, [48, 96], 0)\n(1, [96], 1)\n"
                       "# decode buckets\n([1, 2], 1, [8, 32])\n")
    bounds = '{"min_pixels": 1024, "max_pixels": 2048}'
    srv = start_server_fn(folder, "--dtype", "float32", "--block-size", "8",
                          "--execution-mode", "compile", "--max-model-len", "128",
                          "--max-num-seqs", "2", "--served-model-name", "tiny-qwen",
                          "--limit-mm-per-prompt", '{"image": 2}',
                          "--mm-processor-kwargs", bounds,
                          env={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        bounded = ref.with_bounds(1024, 2048)
        rng = random.Random(1)
        for i in range(6):
            images = [random_image(rng.randint(8, 160), rng.randint(8, 160), 300 + 2 * i + k)
                      for k in range(rng.choice([1, 2]))]
            content = [_part(data_uri(image)) for image in images]
            content.append({"type": "text", "text": "the fox"})
            assert _chat(client, content) == _expected(bounded, content, images)
        metrics = httpx.get(srv.base_url + "/metrics").text
        serving = _metric(metrics, "hpu_serve:graph_compilations_total", 'stage="serving"')
        assert serving and all(v == 0 for v in serving), serving
        encoder = _metric(metrics, "hpu_serve:graph_compilations_total", 'phase="encoder"',
                          'stage="warmup"')
        assert encoder == [4]  # the buckets of 64, 128, 256 and 512 patches
        misses = _metric(metrics, "hpu_serve:bucket_misses_total")
        assert misses and all(v == 0 for v in misses), misses
    finally:
        srv.stop()

