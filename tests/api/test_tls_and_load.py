"""TLS (vLLM's --ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-cert-reqs) and server load
tracking (--enable-server-load-tracking, GET /load). One HTTPS server serves both checks:
each start of a real server costs a minute on a busy machine."""

from __future__ import annotations

import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_process import MODEL_NAME, TINY_FLAGS, start_server

from server.api.app import build_app
from server.api.load import runs_the_model
from server.cli import main
from server.config import ServerConfig


def self_signed(folder: Path, name: str = "server") -> tuple[str, str]:
    """(certificate, key) for 127.0.0.1 and localhost, made with the openssl CLI."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def tls_server(tiny_model, tmp_path_factory):
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    srv = start_server(tiny_model[0], *TINY_FLAGS, "--ssl-certfile", cert, "--ssl-keyfile",
                       key, "--enable-server-load-tracking", wait=False)
    url = f"https://127.0.0.1:{srv.port}"
    deadline = time.monotonic() + 300
    while True:
        assert srv.proc.poll() is None, srv.log()[-3000:]
        try:
            if httpx.get(url + "/health", verify=ssl.create_default_context(cafile=cert),
                         timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.2)
    yield srv, url, ssl.create_default_context(cafile=cert)
    srv.stop()


@pytest.mark.slow
def test_https_with_httpx_and_the_openai_sdk(tls_server) -> None:
    srv, url, trusted = tls_server
    assert httpx.get(url + "/v1/models", verify=trusted, timeout=30).json()["data"][0]["id"] \
        == MODEL_NAME
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(verify=trusted))
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(url + "/health", timeout=30)  # not trusted without the certificate
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the port
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=30)
    assert f"serving {MODEL_NAME} on https://127.0.0.1:{srv.port}" in srv.log()


@pytest.mark.slow
def test_load_counts_requests_while_they_run(tls_server) -> None:
    _, url, trusted = tls_server
    with httpx.Client(base_url=url, verify=trusted, timeout=120) as http:
        assert http.get("/load").json() == {"server_load": 0}
        # a long stream (64 sequences of 500 tokens), read slowly; /load seen meanwhile
        body = {"model": MODEL_NAME, "prompt": "the", "max_tokens": 500, "n": 64,
                "ignore_eos": True, "stream": True}
        seen = set()
        with http.stream("POST", "/v1/completions", json=body) as stream:
            for _ in stream.iter_lines():
                seen.add(http.get("/load").json()["server_load"])
                if 1 in seen:
                    break
        assert 1 in seen, seen
        # the client left: the request is aborted and counts no more
        deadline = time.monotonic() + 60
        while http.get("/load").json()["server_load"] != 0:
            assert time.monotonic() < deadline, "the abandoned stream still counts"
            time.sleep(0.1)


def test_load_is_zero_without_tracking_and_counts_only_model_routes() -> None:
    from fake_engine import FakeEngine

    with TestClient(build_app(FakeEngine(), ServerConfig())) as client:
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert client.get("/load").json() == {"server_load": 0}
    assert runs_the_model("/v1/chat/completions") and runs_the_model("/v1/responses/abc")
    assert not runs_the_model("/v1/models") and not runs_the_model("/v1/completionsX")


def test_a_missing_or_bad_key_file_stops_start_up_in_one_line(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    with pytest.raises(SystemExit, match=r"^error: --ssl-keyfile .*nope\.key: no such file$"):
        main(["serve", "--ssl-certfile", cert, "--ssl-keyfile", str(tmp_path / "nope.key")])
    other_cert, _ = self_signed(tmp_path, "other")
    with pytest.raises(SystemExit, match="error: --ssl-certfile .* cannot load the "
                                         "certificate and its key"):
        main(["serve", "--ssl-certfile", other_cert, "--ssl-keyfile", key])
    with pytest.raises(SystemExit, match="--ssl-cert-reqs needs --ssl-ca-certs"):
        main(["serve", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"])


def test_api_server_count_above_one_is_refused_naming_it() -> None:
    with pytest.raises(SystemExit, match="error: --api-server-count 2: one API server "
                                         "process serves here"):
        main(["serve", "--api-server-count", "2"])
