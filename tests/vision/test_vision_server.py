"""Images through the real HTTP server and the official openai SDK: the tiny LLaVA's answers
equal transformers' greedy text (one and two images, PNG / JPEG / WebP, several sizes), the
encoder cache reports a hit, and bad images (corrupt, a 50000 x 50000 header, an unsupported
type, too many, unreachable, outside the allowed folder) are 400s naming the problem with
no memory spike, the server healthy after."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import httpx
import openai
import pytest
from server_process import free_port
from vision_helpers import data_uri, random_image, reference_ids

MAX_TOKENS = 8


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` RGB pixels, with one tiny IDAT: decoding
    it would allocate width * height * 3 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def server(tiny_llava, start_server_fn, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    random_image(48, 64, seed=7).save(media / "local.png")
    srv = start_server_fn(tiny_llava[0], "--dtype", "float32", "--block-size", "8",
                          "--enforce-eager", "--max-model-len", "256",
                          "--served-model-name", "tiny-llava",
                          "--limit-mm-per-prompt", '{"image": 2}',
                          "--allowed-local-media-path", str(media),
                          env={"VLLM_IMAGE_FETCH_TIMEOUT": "2"})
    srv.media = media
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, content: list[dict]) -> str:
    resp = client.chat.completions.create(
        model="tiny-llava", messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return resp.choices[0].message.content


def _expected(tiny_llava, content: list[dict], images: list) -> str:
    _, model, processor = tiny_llava
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    text = processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True)
    ids = reference_ids(model, processor, text, images, MAX_TOKENS)
    return processor.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow  # a server start and a dozen references (~30 s on two shared cores)
def test_sdk_answers_equal_transformers(server, client, tiny_llava) -> None:
    wide, tall, square = (random_image(90, 40, 1), random_image(25, 80, 2),
                          random_image(33, 33, 3))
    one = [_part(data_uri(wide)), {"type": "text", "text": "the quick brown fox"}]
    assert _chat(client, one) == _expected(tiny_llava, one, [wide])
    # two images in one message, JPEG and WebP (decoded as the server decodes them)
    from PIL import Image
    two = [{"type": "text", "text": "the lazy dog"}, _part(data_uri(tall, "JPEG")),
           {"type": "text", "text": "and"}, _part(data_uri(square, "WEBP"))]
    decoded = [Image.open(__import__("io").BytesIO(base64.b64decode(
        p["image_url"]["url"].split(",", 1)[1]))).convert("RGB") for p in two[1::2]]
    assert _chat(client, two) == _expected(tiny_llava, two, decoded)
    # a file under --allowed-local-media-path
    local = [_part((server.media / "local.png").as_uri()), {"type": "text", "text": "numbers"}]
    assert _chat(client, local) == _expected(
        tiny_llava, local, [Image.open(server.media / "local.png").convert("RGB")])
    # the same image again after other text: the encoder cache answers it
    again = [{"type": "text", "text": "paged attention"}, _part(data_uri(wide))]
    assert _chat(client, again) == _expected(tiny_llava, again, [wide])
    metrics = httpx.get(server.base_url + "/metrics").text
    hits = [line for line in metrics.splitlines()
            if line.startswith("hpu_serve:encoder_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 1, hits
    # the same counts under vLLM's names
    for ours, vllms in (("hpu_serve:encoder_cache_hits_total", "vllm:mm_cache_hits_total"),
                        ("hpu_serve:encoder_cache_queries_total",
                         "vllm:mm_cache_queries_total")):
        pair = [line.split()[-1] for line in metrics.splitlines()
                if line.startswith((ours + "{", vllms + "{"))]
        assert len(pair) == 2 and pair[0] == pair[1], (ours, pair)


@pytest.mark.slow  # shares the server of the test above
def test_bad_images_are_400s_naming_the_problem(server, client) -> None:
    rss_before = _peak_rss_kib(server.proc.pid)
    closed_port = free_port()
    bomb = "data:image/png;base64," + base64.b64encode(_png_header_only(50000, 50000)).decode()
    truncated = data_uri(random_image(64, 64, 4))[:-400]
    cases = [
        ([_part("data:image/png;base64," + base64.b64encode(b"not an image" * 50).decode())],
         "not a PNG, JPEG or WebP"),
        ([_part(truncated)], "image"),
        ([_part(bomb)], "50000x50000 pixels"),
        ([_part("data:image/gif;base64,R0lGODlhAQABAAAAACw=")], "unsupported image type"),
        ([_part(data_uri(random_image(8, 8, 5)))] * 3, "at most 2 images per prompt"),
        ([_part(f"http://127.0.0.1:{closed_port}/cat.png")],
         f"http://127.0.0.1:{closed_port}/cat.png"),
        ([_part("file:///etc/passwd")], "outside --allowed-local-media-path"),
        ([_part("ftp://example.com/cat.png")], "scheme"),
    ]
    for content, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, content + [{"type": "text", "text": "what is it?"}])
        assert info.value.status_code == 400
        assert words in info.value.message, (words, info.value.message)
    # decoding the bomb would take 7.5 GB; the server's peak grew by far less
    assert _peak_rss_kib(server.proc.pid) - rss_before < 200 * 1024
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert _chat(client, [_part(data_uri(random_image(20, 20, 6)))])  # still serving


@pytest.mark.slow  # compiles every bucket before the port opens (~3 min on two cores)
def test_compile_mode_through_the_sdk_compiles_nothing_while_serving(
        tiny_llava, start_server_fn, tmp_path) -> None:
    import random

    buckets = tmp_path / "buckets.txt"
    buckets.write_text("# prompt buckets\n(1, [48, 96], 0)\n"
                       "# decode buckets\n([1, 2], 1, [8, 32])\n")
    srv = start_server_fn(tiny_llava[0], "--dtype", "float32", "--block-size", "8",
                          "--execution-mode", "compile", "--max-model-len", "128",
                          "--max-num-seqs", "2", "--served-model-name", "tiny-llava",
                          "--limit-mm-per-prompt", '{"image": 2}',
                          env={"VLLM_BUCKETING_FROM_FILE": str(buckets)})
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        rng = random.Random(1)
        for i in range(6):
            images = [random_image(rng.randint(8, 160), rng.randint(8, 160), 300 + 2 * i + k)
                      for k in range(rng.choice([1, 2]))]
            content = [_part(data_uri(image)) for image in images]
            content.append({"type": "text", "text": "the fox"})
            assert _chat(client, content) == _expected(tiny_llava, content, images)
        metrics = httpx.get(srv.base_url + "/metrics").text
        serving = [line for line in metrics.splitlines()
                   if line.startswith("hpu_serve:graph_compilations_total")
                   and 'stage="serving"' in line]
        assert serving and all(float(line.split()[-1]) == 0 for line in serving), serving
        encoder = [line for line in metrics.splitlines()
                   if line.startswith("hpu_serve:graph_compilations_total")
                   and 'phase="encoder"' in line and 'stage="warmup"' in line]
        assert float(encoder[0].split()[-1]) == 3  # the buckets of 1, 2 and 4 images
        misses = [line for line in metrics.splitlines()
                  if line.startswith("hpu_serve:bucket_misses_total")]
        assert misses and all(float(line.split()[-1]) == 0 for line in misses), misses
    finally:
        srv.stop()
