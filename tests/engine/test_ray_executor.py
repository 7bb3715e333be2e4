"""--distributed-executor-backend ray on a two-node Ray cluster of this host.

The cluster is started here: a head node with one CPU and a second node with one CPU.
With one CPU bundle per rank and rank 0's pinned to the server's node (the head), rank 1's
actor is placed on the other node: the placement and the rendezvous at the node's address
(not loopback) are exercised as with two hosts. Skipped without the optional ``ray`` package
(``pip install 'hpu-serve[ray]'``). About 30 s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip(
    "ray", reason="--distributed-executor-backend ray needs the optional ray package "
                  "(pip install 'hpu-serve[ray]')")

from server.config import make_engine_config  # noqa: E402
from test_tensor_parallel import PROMPTS, SMALL, assert_same, generate  # noqa: E402


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
    from server.engine.llm_engine import LLMEngine

    folder, _, _ = tiny_model_factory(num_kv_heads=1)
    config = make_engine_config(model=folder, dtype="float32", tensor_parallel_size=2,
                                **RAY_TP2)
    died: list[BaseException] = []
    engine = AsyncEngine(lambda: LLMEngine(config), on_dead=died.append)
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
