"""Outage 2 of issue 33, reproduced through a real server with its default connection flags:
one client (127.0.0.2) holds about 1,000 connections that send nothing, reopening each one
the server closes, while a control completion from 127.0.0.1 keeps being answered 200
within twice its idle latency plus a margin. Before the fix every control request got 503
(the cap of 512 counted the silent connections)."""

from __future__ import annotations

import multiprocessing
import os
import resource
import selectors
import socket
import statistics
import time

import httpx
import pytest
from server_process import MODEL_NAME, TINY_FLAGS, start_server

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

ATTACKER = "127.0.0.2"  # loopback too: the server sees a second address
CONNECTIONS = 1000
ATTACK_SECONDS = 8.0
# Latency margin on top of 2x the idle latency: the machine is shared and noisy, and the
# attacker's reconnect loop competes with the server for its cores. Before the fix the
# control request does not get slow, it gets 503; a stalled accept loop shows as seconds.
MARGIN = 1.0
CONTROL = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}


def raise_own_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


def attack(port: int, seconds: float, report: multiprocessing.Queue) -> None:
    """Holds ``CONNECTIONS`` silent connections from ``ATTACKER`` for ``seconds``; each one
    the server closes is reopened at once. Reports how many were opened and the most held
    open at once (connected and not yet closed by the server).

    It runs at the lowest priority: a real attacker's reconnect loop runs on its own
    machine, not on the server's cores; here, on a small shared machine, an unniced Python
    loop would take a whole core from the server and measure CPU theft, not the server."""
    os.nice(19)
    raise_own_fd_limit(CONNECTIONS + 200)
    sel = selectors.DefaultSelector()
    opened = 0

    def open_one() -> None:
        nonlocal opened
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((ATTACKER, 0))
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sel.register(sock, selectors.EVENT_READ)
        opened += 1

    for _ in range(CONNECTIONS):
        open_one()
    peak = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        closed = 0
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            try:
                data = sock.recv(1024)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:  # the server should never speak to a silent connection
                report.put(("spoke", data[:200]))
            sel.unregister(sock)
            sock.close()
            closed += 1
        peak = max(peak, len(sel.get_map()) - closed)
        for _ in range(closed):
            open_one()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    report.put(("done", opened, peak))


def control(server) -> tuple[int, float]:
    start = time.monotonic()
    resp = httpx.post(server.base_url + "/v1/completions", json=CONTROL, timeout=60)
    return resp.status_code, time.monotonic() - start


@pytest.fixture(scope="module")
def srv(tiny_model):
    server = start_server(tiny_model[0], *TINY_FLAGS)  # default connection flags
    yield server
    server.stop()


def test_a_thousand_silent_connections_from_one_address_stop_no_one(srv) -> None:
    for _ in range(3):
        control(srv)  # warm-up
    idle = statistics.median(control(srv)[1] for _ in range(10))

    report: multiprocessing.Queue = multiprocessing.get_context("fork").Queue()
    attacker = multiprocessing.get_context("fork").Process(
        target=attack, args=(srv.port, ATTACK_SECONDS, report))
    attacker.start()
    ends = time.monotonic() + ATTACK_SECONDS - 1.0
    try:
        time.sleep(1.0)  # the connections are open
        during: list[tuple[int, float]] = []
        while time.monotonic() < ends and attacker.is_alive():
            during.append(control(srv))
        tag, *rest = report.get(timeout=60)
    finally:
        attacker.join(timeout=30)
        if attacker.is_alive():
            attacker.kill()
    assert tag == "done", (tag, rest)
    opened, peak = rest
    statuses = [status for status, _ in during]
    latencies = sorted(latency for _, latency in during)
    worst = latencies[-1]
    print(f"idle {idle * 1000:.1f} ms; {len(during)} control requests during the attack, "
          f"median {statistics.median(latencies) * 1000:.1f} ms, worst {worst * 1000:.1f} ms; "
          f"attacker opened {opened} connections, held at most {peak} at once")
    assert len(during) >= 5
    assert statuses == [200] * len(during), statuses
    assert worst < 2 * idle + MARGIN, (idle, worst)
    assert opened > CONNECTIONS  # the server closed silent connections, and they came back
    assert peak >= CONNECTIONS * 0.9  # the attacker really held about 1,000 at once
    health = httpx.get(srv.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert control(srv)[0] == 200

