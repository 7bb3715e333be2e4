"""--distributed-executor-backend ray on a two-node Ray cluster of this host.

A cluster is started here: a head node with one CPU and a second node with one CPU.
With one CPU bundle per rank and rank 0's pinned to the server's node (the head), rank 1's
actor is placed on the other node: the placement and the rendezvous at the node's address
(not loopback) are exercised as with two hosts. Skipped without the optional ``ray`` package
(``pip install 'hpu-serve[ray]'``); about 35 s on two cores.

Opt-in (HPU_SERVE_TEST_RAY_SERVER=1, about 30 s more): a server with no cluster to join
starts its own local one, serves, drains on SIGTERM and leaves no Ray process behind.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray", reason="--distributed-executor-backend ray needs the optional ray package "
                  "(pip install 'hpu-serve[ray]')")

from test_tensor_parallel import PROMPTS, SMALL, assert_same, generate  # noqa: E402

from server.config import make_engine_config  # noqa: E402


def children(pid: int) -> list[int]:
    """Every process started by ``pid``, directly or not (Linux /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        found += kids
        todo += kids
    return found


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] \
            != "Z"
    except OSError:
        return False


@pytest.mark.skipif(os.environ.get("HPU_SERVE_TEST_RAY_SERVER") != "1",
                    reason="~30 s more: opt in with HPU_SERVE_TEST_RAY_SERVER=1")
def test_server_with_its_own_local_ray_drains_and_leaves_nothing(
        tiny_model_factory, start_server_fn, tiny_flags) -> None:
    # first in this file: no cluster runs yet, so the server starts a local one; the
    # engine is built on a thread that ends before shutdown, which must not take Ray's
    # processes with it (their parent-death signal follows the starting thread)
    import httpx

    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    server = start_server_fn(folder, *tiny_flags, "--tensor-parallel-size", "2",
                             "--distributed-executor-backend", "ray", env={"RAY_ADDRESS": ""})
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "the quick brown fox",
                "max_tokens": 4, "temperature": 0}
        resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert "Started a local Ray instance" in server.log()
        assert "Tensor-parallel rank 1 ready" in server.log()
        ray_processes = children(server.proc.pid)
        assert ray_processes
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log()
        assert "Tensor-parallel workers stopped" in server.log()
        wait_for(lambda: not any(running(p) for p in ray_processes), 20,
                 "Ray processes left behind")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The address of a head node and one more node, one CPU each, that this process
    joins as a driver (the executor then uses that connection rather than its own).
    ``Cluster`` (Ray's own test helper) starts them as two sets of node processes, as
    ``ray start --head`` and ``ray start --address`` would, and ends exactly those."""
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, num_gpus=0, object_store_memory=80_000_000)
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_for(check, timeout: float, what: str) -> None:  # noqa: ANN001 - a callable
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


RAY_TP2 = dict(distributed_executor_backend="ray", **SMALL)


def test_ray_tp2_matches_tp1_greedy(ray_cluster: str, tiny_model_factory) -> None:
    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    reference = generate(folder, 1, PROMPTS, 16, **SMALL)
    parallel = generate(folder, 2, PROMPTS, 16, **RAY_TP2)
    assert_same(reference, parallel)
    # the executor left nothing on the cluster: its placement group is removed
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)


def test_killed_actor_turns_health_503(ray_cluster: str, tiny_model_factory) -> None:
    from fastapi.testclient import TestClient

    from server.api.app import build_app
    from server.config import ServerConfig
    from server.engine.async_engine import AsyncEngine

    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    config = make_engine_config(model=folder, dtype="float32", tensor_parallel_size=2,
                                **RAY_TP2)
    died: list[BaseException] = []
    engine = AsyncEngine.from_config(config, on_dead=died.append)
    executor = engine.engine.executor
    assert executor is not None
    actor = executor.actors[0]
    # one bundle per rank; with one CPU per node, rank 1's is on the other node
    table = ray.util.placement_group_table(executor._group)
    assert len(set(table["bundles_to_node_id"].values())) == 2, table
    with TestClient(build_app(engine, ServerConfig())) as client:
        assert client.get("/health").status_code == 200
        ray.kill(actor, no_restart=True)
        start = time.monotonic()
        while client.get("/health").status_code == 200 and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert client.get("/health").status_code == 503
        assert died and "rank 1 (Ray actor)" in str(died[0])
    assert executor.actors == []  # the fault killed the rest and freed the bundles
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.node_ip.remote(), timeout=10)
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups)
