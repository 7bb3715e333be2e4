"""Stand-in for vLLM's ``tests/conftest.py`` (installed as ``tests/conftest.py`` of the
staging tree), which needs vLLM: the one name the HTTP tests import from it.

``LocalAssetServer`` serves vLLM's test images over HTTP on loopback, as vLLM's does; their
files come from the hub, so each name asked for is a random JPEG made here instead (the tests
that use them read the metrics of an image request, not the answer)."""

from __future__ import annotations

import functools
import hashlib
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class LocalAssetServer:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="vllm-assets-"))
        handler = functools.partial(_Quiet, directory=str(self.root))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def url_for(self, name: str) -> str:
        path = self.root / name
        if not path.exists():
            import numpy as np
            from PIL import Image

            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
            pixels = np.random.default_rng(seed).integers(0, 256, (240, 320, 3), np.uint8)
            Image.fromarray(pixels).save(path, format="JPEG")
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="session")
def local_asset_server():
    server = LocalAssetServer()
    yield server
    server.close()
