"""A tensor-parallel server's lifecycle: a dead worker takes the server down (503, then a
non-zero exit), SIGTERM drains and stops every rank, and no process is left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow  # make test-fast skips it; make test (CI) runs it

TP_FLAGS = ("--tensor-parallel-size", "2")


def worker_pids(server) -> list[int]:  # noqa: ANN001 - server_process.ServerProcess
    return [int(p) for p in re.findall(r"worker rank \d+ started \(pid (\d+)\)", server.log())]


def gone(pid: int) -> bool:
    """Not running any more (exited; a zombie waiting to be reaped is dead too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not gone(p)]


@pytest.fixture()
def tp_server(tiny_model_factory, start_server_fn, tiny_flags):
    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    server = start_server_fn(folder, *tiny_flags, *TP_FLAGS)
    try:
        yield server
    finally:
        server.stop()
        for pid in worker_pids(server):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_tp_server_answers_like_one_rank(tp_server) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "the quick brown fox",
            "max_tokens": 8, "temperature": 0}
    resp = httpx.post(tp_server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8
    assert len(worker_pids(tp_server)) == 1
    assert "Tensor-parallel rank 1/2" in tp_server.log()


def test_killed_worker_turns_health_503_and_exits_non_zero(tp_server) -> None:
    (pid,) = worker_pids(tp_server)
    assert httpx.get(tp_server.base_url + "/health", timeout=5).status_code == 200
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    saw_503 = False
    while time.monotonic() - start < 5.0 and not saw_503:
        try:
            saw_503 = httpx.get(tp_server.base_url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:  # the port already closed: the process is on its way out
            if tp_server.proc.poll() is not None:
                break
        time.sleep(0.05)
    assert saw_503 or tp_server.proc.poll() is not None, tp_server.log()
    assert time.monotonic() - start < 5.0
    code = tp_server.proc.wait(timeout=60)
    assert code != 0, tp_server.log()
    assert "worker rank 1" in tp_server.log() and "died" in tp_server.log()


def test_sigterm_drains_in_flight_requests_and_stops_every_rank(tp_server) -> None:
    pids = worker_pids(tp_server)
    results: list[str | None] = [None] * 3
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"numbers {i}", "max_tokens": 48,
                "temperature": 0, "ignore_eos": True, "stream": True}
        finish = None
        with httpx.stream("POST", tp_server.base_url + "/v1/completions", json=body,
                          timeout=60) as resp:
            first = True
            for line in resp.iter_lines():
                if first:
                    started.wait(30)
                    first = False
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        results[i] = finish

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(30)
    tp_server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert results == ["length"] * 3, tp_server.log()
    assert tp_server.proc.wait(timeout=60) == 0, tp_server.log()
    assert wait_gone([tp_server.proc.pid, *pids]) == []
    assert "Tensor-parallel rank 1 stopped" in tp_server.log()


def test_health_turns_503_within_5_s_of_a_worker_death(tiny_model_factory) -> None:
    # in process: the server exits so fast after a death that a poll may never see the 503
    from fastapi.testclient import TestClient

    from server.api.app import build_app
    from server.config import ServerConfig, make_engine_config
    from server.engine.async_engine import AsyncEngine

    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    config = make_engine_config(model=folder, dtype="float32", tensor_parallel_size=2,
                                block_size=16, max_num_seqs=8, max_model_len=256)
    died: list[BaseException] = []
    engine = AsyncEngine.from_config(config, on_dead=died.append)
    executor = engine.engine.executor
    assert executor is not None
    with TestClient(build_app(engine, ServerConfig())) as client:
        assert client.get("/health").status_code == 200
        os.kill(executor.workers[0].pid, signal.SIGKILL)
        start = time.monotonic()
        while client.get("/health").status_code == 200 and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert client.get("/health").status_code == 503
        assert time.monotonic() - start < 5.0
        # the engine is marked dead (the 503) before the listener hears of it
        while not died and time.monotonic() - start < 5:
            time.sleep(0.01)
        assert died and "rank 1" in str(died[0])
    assert not executor.workers[0].is_alive()


def test_workers_exit_when_the_server_is_killed(tp_server) -> None:
    pids = worker_pids(tp_server)
    tp_server.proc.kill()  # SIGKILL: no shutdown code runs in rank 0
    tp_server.proc.wait(timeout=10)
    assert wait_gone(pids, timeout=10) == []
