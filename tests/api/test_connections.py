"""Connection hygiene against a real server, with raw sockets: stalled headers and bodies
are cut after their timeouts (408), idle keep-alive connections are closed, a connection
that sends nothing is closed at the idle deadline and one address holds only so many of
them, the cap on requests in flight answers a JSON 503 (silent connections do not count
against it), and a chunked body over the size limit is a 413."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_process import TINY_FLAGS, start_server

from server.api.connections import SILENT_GRACE_S

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

HEADER_TIMEOUT = 1.5
BODY_TIMEOUT = 3.0
KEEP_ALIVE = 1.0
LIMIT = 3
MAX_BODY = 4096
IDLE_TIMEOUT = 2.5
IDLE_PER_ADDRESS = 4


@pytest.fixture(scope="module")
def srv(tiny_model):
    server = start_server(tiny_model[0], *TINY_FLAGS,
                          "--timeout-request-header", str(HEADER_TIMEOUT),
                          "--timeout-request-body", str(BODY_TIMEOUT),
                          "--timeout-keep-alive", str(KEEP_ALIVE),
                          "--limit-concurrency", str(LIMIT),
                          "--max-request-body-bytes", str(MAX_BODY),
                          "--timeout-idle-connection", str(IDLE_TIMEOUT),
                          "--max-idle-connections-per-address", str(IDLE_PER_ADDRESS))
    yield server
    server.stop()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def read_until_closed(sock: socket.socket, limit: float = 20.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and when it closed."""
    start = time.monotonic()
    sock.settimeout(limit)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request_head(path: str = "/v1/completions", length: int = 100) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def healthy(server) -> bool:
    return httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_a_partial_header_is_cut_after_the_header_timeout(srv) -> None:
    with connect(srv) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        data, elapsed = read_until_closed(sock)
    status, body = status_and_json(data)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "headers" in body["error"]["message"]
    assert HEADER_TIMEOUT * 0.8 < elapsed < HEADER_TIMEOUT + 3
    assert healthy(srv)


def test_a_silent_connection_is_closed_at_the_idle_deadline_without_a_response(srv) -> None:
    with connect(srv) as sock:
        data, elapsed = read_until_closed(sock)
    assert data == b""  # no request, nothing to answer
    assert IDLE_TIMEOUT * 0.8 < elapsed < IDLE_TIMEOUT + 3


def test_the_header_deadline_runs_from_the_first_byte(srv) -> None:
    """A connection opened ahead of use (a pool, a browser's preconnect) that speaks before
    the idle deadline gets the whole header deadline from its first byte."""
    with connect(srv) as sock:
        time.sleep(IDLE_TIMEOUT * 0.6)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        data, elapsed = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and b"headers" in data
    assert HEADER_TIMEOUT * 0.8 < elapsed < HEADER_TIMEOUT + 3


def test_one_address_holds_only_so_many_silent_connections(srv) -> None:
    """Beyond --max-idle-connections-per-address the oldest silent ones (silent for over a
    second) are closed at once, long before their idle deadline; the newest stay until the
    idle deadline, and one that speaks is served."""
    surplus = 3
    socks = [connect(srv) for _ in range(surplus)]
    time.sleep(SILENT_GRACE_S + 0.2)
    for _ in range(IDLE_PER_ADDRESS):
        socks.append(connect(srv))
        time.sleep(0.05)  # the server sees them in this order
    try:
        start = time.monotonic()
        for sock in socks[:surplus]:
            data, _ = read_until_closed(sock, limit=0.5)
            assert data == b""
        # closed by the limit: their idle deadline is still ahead
        assert time.monotonic() - start < 0.5
        assert time.monotonic() - start + SILENT_GRACE_S + 0.2 < IDLE_TIMEOUT
        for sock in socks[surplus:]:  # still open: a recv would time out, not return b""
            sock.settimeout(0.2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        socks[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        socks[-1].settimeout(10)
        assert socks[-1].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()


def test_a_burst_of_connections_from_one_address_is_served(srv) -> None:
    """A client opening many connections at once (a load generator, a gateway's pool) sends
    on each a moment later: none is lost to the per-address limit of silent connections."""
    socks = [connect(srv) for _ in range(IDLE_PER_ADDRESS * 4)]
    try:
        time.sleep(0.3)
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in socks:
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in socks:
            sock.close()


def test_dribbling_a_header_does_not_extend_the_deadline(srv) -> None:
    line = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    start = time.monotonic()
    with connect(srv) as sock:
        try:
            for byte in line:  # one byte every 0.1 s: 5 s in all
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass  # the server closed the connection
        data, _ = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < HEADER_TIMEOUT + 3


def test_a_stalled_body_is_cut_after_the_body_timeout(srv) -> None:
    with connect(srv) as sock:
        sock.sendall(request_head(length=100) + b'{"prompt": "hi"')
        data, elapsed = read_until_closed(sock)
    status, body = status_and_json(data)
    assert status == 408 and "body" in body["error"]["message"]
    assert BODY_TIMEOUT * 0.8 < elapsed < BODY_TIMEOUT + 3
    assert healthy(srv)


def test_a_slow_body_that_keeps_coming_is_served(srv) -> None:
    payload = json.dumps({"prompt": "hi", "max_tokens": 1}).encode().ljust(60)
    pieces = [payload[i:i + 10] for i in range(0, len(payload), 10)]
    with connect(srv) as sock:
        sock.sendall(request_head(length=len(payload)))
        for piece in pieces:  # 6 x 0.7 s: longer than either timeout, no pause beyond one
            time.sleep(0.7)
            sock.sendall(piece)
        sock.settimeout(30)
        data = sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200"), data[:200]


def test_an_idle_keep_alive_connection_is_closed(srv) -> None:
    with connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, elapsed = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200") and b'{"status":"ok"}' in data
    assert elapsed < KEEP_ALIVE + 3


def test_the_connection_cap_answers_a_json_503_and_health_stays_up(srv) -> None:
    time.sleep(KEEP_ALIVE + 0.5)  # connections of earlier tests are gone
    holders = [connect(srv) for _ in range(LIMIT)]
    try:
        for sock in holders:  # each holds its connection: headers in, body still coming
            sock.sendall(request_head(length=100) + b"{")
        time.sleep(0.3)
        refused = httpx.get(srv.base_url + "/v1/models", timeout=10)
        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"] == "application/json"
        assert refused.headers["connection"] == "close"
        error = refused.json()["error"]
        assert error["code"] == "too_many_connections" and "--limit-concurrency" in error["message"]
        assert healthy(srv)  # probes are always served
    finally:
        for sock in holders:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 200


def test_silent_connections_do_not_count_against_the_cap(srv) -> None:
    """Outage 2 of issue 33 in small: more silent connections than --limit-concurrency (from
    two addresses, within each one's share) and a request is still served."""
    silent = [connect(srv) for _ in range(IDLE_PER_ADDRESS)]
    for _ in range(IDLE_PER_ADDRESS):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", srv.port))
        silent.append(sock)
    assert len(silent) > LIMIT + 1
    try:
        time.sleep(0.3)
        resp = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                          json={"prompt": "Hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
    finally:
        for sock in silent:
            sock.close()


def test_a_chunked_body_over_the_limit_is_413(srv) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b" " * 2000

    resp = httpx.post(srv.base_url + "/v1/completions", content=chunks(), timeout=30,
                      headers={"content-type": "application/json"})
    assert "content-length" not in resp.request.headers  # it really went chunked
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"]["code"] == "request_too_large"
    small = httpx.post(srv.base_url + "/v1/completions", timeout=30,
                       content=iter([b'{"prompt": "hi", ', b'"max_tokens": 1}']),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text


def test_the_server_raises_its_open_files_limit_to_the_hard_one() -> None:
    """A thousand idle connections need a thousand descriptors: the usual soft limit of 1,024
    would make accept() fail for everyone. Started with a low soft limit, the server lifts it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"hard open-files limit is {hard}")
    code = ("import resource; from server.api.http_server import raise_fd_limit; "
            "raise_fd_limit(); print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    assert [int(v) for v in out.stdout.split()] == [hard, hard]
