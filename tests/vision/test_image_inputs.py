"""Fast checks of image input without a model: URL loading and its refusals, the chunk rule
that keeps an image whole, block names that carry image hashes, the encoder plan, the flag."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vision_helpers import data_uri, random_image

from server.api.errors import APIError
from server.api.media.loading import load_image
from server.config.multimodal import parse_mm_limits
from server.engine.core.block_manager import BlockManager
from server.engine.core.sequence import Sequence
from server.engine.multimodal.inputs import ImageSpan, VisionInfo, block_images, chunk_end
from server.engine.sampling_params import SamplingParams
from server.hpu.buckets.encoder import encoder_buckets, max_encoder_images


def rules(tmp_path: Path | None = None, **kw) -> VisionInfo:
    base = dict(image_limit=2, allowed_local_media_path=str(tmp_path or ""), fetch_timeout=1.0,
                max_image_bytes=1 << 20, max_image_pixels=4096 * 4096)
    return VisionInfo(**{**base, **kw})


def refused(url: str, info: VisionInfo) -> str:
    with pytest.raises(APIError) as exc:
        load_image(url, info, "messages.0.content.0.image_url.url")
    assert exc.value.status == 400
    assert exc.value.param == "messages.0.content.0.image_url.url"
    return exc.value.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_uris_decode_to_rgb(fmt: str) -> None:
    image = load_image(data_uri(random_image(40, 20, 1), fmt), rules(), "p")
    assert image.mode == "RGB" and image.size == (40, 20)


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    info = rules(tmp_path)
    assert "not valid base64" in refused("data:image/png;base64,@@@", info)
    assert "unsupported image type 'image/gif'" in refused("data:image/gif;base64,AAAA", info)
    assert "must be base64" in refused("data:image/png,rawbytes", info)
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (2 << 20)).decode()
    assert "more than the limit of 1048576" in refused(big, info)
    wide = data_uri(random_image(100, 10, 2))
    assert "100x10 pixels" in refused(wide, rules(max_image_pixels=999))
    png = io.BytesIO()
    random_image(64, 64, 3).save(png, format="PNG")
    cut = "data:image/png;base64," + base64.b64encode(png.getvalue()[:-300]).decode()
    assert "truncated or corrupt" in refused(cut, info)


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    random_image(10, 10, 4).save(tmp_path / "ok.png")
    assert load_image((tmp_path / "ok.png").as_uri(), rules(tmp_path), "p").size == (10, 10)
    assert "outside --allowed-local-media-path" in refused("file:///etc/hostname",
                                                            rules(tmp_path))
    assert "need the server started with" in refused((tmp_path / "ok.png").as_uri(), rules())
    assert "cannot be read" in refused((tmp_path / "gone.png").as_uri(), rules(tmp_path))


def test_http_fetch_cap_timeout_and_status() -> None:
    body = io.BytesIO()
    random_image(16, 16, 5).save(body, format="PNG")
    stall = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/slow.png":
                stall.wait(5)
            if self.path == "/missing.png":
                self.send_error(404)
                return
            data = body.getvalue() * (100 if self.path == "/big.png" else 1)
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading at its cap

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert load_image(f"{base}/cat.png", rules(), "p").size == (16, 16)
        small = rules(max_image_bytes=len(body.getvalue()) * 10)
        assert "more than the limit" in refused(f"{base}/big.png", small)
        assert "answered HTTP 404" in refused(f"{base}/missing.png", rules())
        assert f"{base}/slow.png did not answer within 1 s" in refused(f"{base}/slow.png",
                                                                       rules())
    finally:
        stall.set()
        server.shutdown()


def test_chunk_end_keeps_an_image_whole() -> None:
    spans = [ImageSpan(10, 25, b"a"), ImageSpan(40, 25, b"b")]
    assert chunk_end(spans, 0, 32, 32) == 10  # would cut image a: stop before it
    assert chunk_end(spans, 10, 32, 42) == 35  # starts at image a: all of it, if in budget
    assert chunk_end(spans, 10, 32, 30) == 10  # ...else nothing this step
    assert chunk_end(spans, 35, 70, 70) == 70  # not cutting anything
    # a prefix-cache hit that ends inside image a: the rest of it in one chunk
    assert chunk_end(spans, 16, 32, 48) == 35
    assert chunk_end(spans, 16, 32, 30) == 16
    assert chunk_end([], 0, 16, 16) == 16


def test_block_names_carry_the_image_hash() -> None:
    def seq(image: bytes) -> Sequence:
        s = Sequence(0, "r", 0, [1] * 20 + [9] * 8 + [2] * 5, SamplingParams(), 0.0,
                     images=(ImageSpan(20, 8, image),))
        return s

    assert block_images(seq(b"x").images, 16, 24) == b"x"
    assert block_images(seq(b"x").images, 0, 16) == b""
    manager = BlockManager(16, 8, enable_caching=True)
    first = seq(b"x")
    manager.allocate(first)
    manager.cache_blocks(first, 32)
    assert manager.num_cached_tokens(seq(b"y")) == 16  # blocks 0-1; block 2 holds the image
    assert manager.num_cached_tokens(seq(b"x")) == 32


def test_encoder_plan_and_flag() -> None:
    assert encoder_buckets(5) == [1, 2, 4, 5]
    assert encoder_buckets(1) == [1]
    assert max_encoder_images(2, 4, 512, 25) == 8
    assert max_encoder_images(4, 64, 100, 576) == 1
    assert parse_mm_limits('{"image": 3}') == {"image": 3}
    assert parse_mm_limits('{"image": {"count": 1}}') == {"image": 1}
    for bad, words in (('{"video": 1}', "not served"), ("[1]", "JSON object"),
                       ('{"image": -1}', "count >= 0"), ("x", "expected JSON")):
        with pytest.raises(ValueError, match=words):
            parse_mm_limits(bad)


def test_buckets_command_prints_the_encoder_plan(tiny_llava, capsys) -> None:
    """``hpu-serve buckets MODEL``: the step plan, then the encoder's (config.json only)."""
    from server.cli import main

    assert main(["buckets", tiny_llava[0], "--max-model-len", "256", "--max-num-seqs", "4",
                 "--limit-mm-per-prompt", '{"image": 2}']) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == ("Generated 4 encoder buckets [images, patches] (3x30x30 pixels per image): "
                    "[(1, 25), (2, 25), (4, 25), (8, 25)]")
    assert main(["buckets", "--max-model-len", "256"]) == 0  # no model: no encoder line
    assert "encoder" not in capsys.readouterr().out
