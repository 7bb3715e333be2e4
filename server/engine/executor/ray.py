"""``--distributed-executor-backend ray``: ranks 1..N-1 as Ray actors, possibly on other hosts.

The server joins the Ray cluster that ``ray.init()`` finds (``RAY_ADDRESS``, else the
cluster last started on this host with ``ray start``); with none, ``ray.init()`` starts a
local one for the server's lifetime. A placement group reserves one bundle per rank, all
at once (no rank starts unless every rank fits): one ``CPU`` on a CPU platform, one ``GPU``
on CUDA, one ``HPU`` on Gaudi (the resource Ray detects on Gaudi nodes; another device type
asks for a custom resource of its upper-case name, to be declared with ``ray start
--resources``). Bundle 0 is pinned to the server's node (Ray's ``node:<ip>`` resource) and
held by a placeholder actor: Ray then hands rank 0's device to no other rank, and the
placeholder reports which device that is. The bundles are packed (fewest nodes first).

Each worker actor runs the same rank loop as an mp worker (:func:`serve_rank`), its one
long call returning only when the loop ends; rank 0 meets the actors at its node's address
as Ray reports it (loopback would not reach another host) on a port free here. A worker
call that ends while serving (the actor died, was killed, or its loop failed) is a worker
death, as for mp. Killing the actors, the placeholder and the placement group is the
executor's kill; Ray also ends them if the server process dies, being their owner.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from server.config import EngineConfig
from server.engine.executor.base import RankExecutor, serve_rank
from server.hpu.platform import Platform

logger = logging.getLogger(__name__)

# how long the cluster may take to reserve every rank's bundle, and to start the actors,
# before start-up fails (an unsatisfiable request would otherwise wait forever)
_PLACEMENT_TIMEOUT_S = 120.0
# how long shutdown waits for Ray to kill the actors and free the placement group
_CLEANUP_TIMEOUT_S = 15.0
# Ray's resource name for one rank's device, by torch device type
_RESOURCES = {"cpu": "CPU", "cuda": "GPU", "hpu": "HPU"}


def rank_resource(device_type: str) -> str:
    """The Ray resource one rank reserves on a platform of ``device_type``."""
    return _RESOURCES.get(device_type, device_type.upper())


def actor_resources(resource: str) -> dict[str, Any]:
    """``.options()`` asking for one ``resource``, as the bundle holds it (CPU and GPU have
    their own keywords; an actor asks for no CPU unless CPU is its device)."""
    if resource == "CPU":
        return {"num_cpus": 1}
    if resource == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {resource: 1}}


class RankActor:
    """A Ray actor that runs one worker rank (and, as the placeholder, holds rank 0's
    bundle)."""

    def node_ip(self) -> str:
        return str(ray.util.get_node_ip_address())

    def device_ids(self) -> dict[str, list[str]]:
        """The accelerators Ray gave this actor ({"GPU": ["3"]}; none on CPU)."""
        return {k: list(v) for k, v in ray.get_runtime_context().get_accelerator_ids().items()
                if v}

    def serve(self, config: EngineConfig, rank: int, host: str, port: int) -> None:
        from server.log import init_logging

        init_logging()
        # Ray makes only this actor's device visible to it: index 0 here
        serve_rank(config, rank, host, port, 0)


class RayExecutor(RankExecutor):
    """Ranks 1..N-1 as Ray actors in a placement group of one bundle per rank."""

    def _start_workers(self, config: EngineConfig, platform: Platform,
                       port: int) -> tuple[str, int]:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _init_ray()
        self.actors: list[Any] = []
        self.calls: list[Any] = []
        self._placeholder: Any = None
        self._group: PlacementGroup | None = None
        host = str(ray.util.get_node_ip_address())
        resource = rank_resource(platform.device.type)
        bundles: list[dict[str, float]] = [{resource: 1.0} for _ in range(self.world_size)]
        bundles[0][f"node:{host}"] = 0.001  # rank 0 is this process: its bundle is here
        self._group = placement_group(bundles, strategy="PACK", name="hpu-serve-tp")
        ready, _ = ray.wait([self._group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise TimeoutError(
                f"the Ray cluster could not reserve {self.world_size} bundles of one "
                f"{resource} (one on this node, {host}) in {_PLACEMENT_TIMEOUT_S:.0f} s; it "
                f"has {ray.cluster_resources()}")
        remote = ray.remote(RankActor)
        self._placeholder = remote.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, 0),
            **actor_resources(resource)).remote()
        device_ids = ray.get(self._placeholder.device_ids.remote(),
                             timeout=_PLACEMENT_TIMEOUT_S)
        local_rank = _first_index(device_ids)
        where: list[Any] = []
        for rank in range(1, self.world_size):
            actor = remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, rank),
                **actor_resources(resource)).remote()
            self.actors.append(actor)
            # asked first: an actor runs its calls in order, and serve never returns
            where.append(actor.node_ip.remote())
            self.calls.append(actor.serve.remote(config, rank, host, port))
        nodes = ray.get(where, timeout=_PLACEMENT_TIMEOUT_S)  # the actors exist
        logger.info("Tensor-parallel ranks 1..%d: Ray actors on %s; rank 0 at %s:%d "
                    "(device %d)", self.world_size - 1, ", ".join(nodes), host, port,
                    local_rank)
        return host, local_rank

    def _describe(self, call: Any) -> str:
        rank = self.calls.index(call) + 1
        try:
            ray.get(call, timeout=5)
            why = "its rank loop returned"
        except ray.exceptions.RayTaskError as exc:  # the rank loop raised: its traceback
            logger.error("tensor-parallel rank %d failed:\n%s", rank, exc)
            lines = str(exc).strip().splitlines()
            why = lines[-1] if lines else type(exc).__name__  # the exception's own line
        except Exception as exc:  # noqa: BLE001 - the actor died: the reason is enough
            lines = str(exc).strip().splitlines()
            why = lines[0] if lines else type(exc).__name__
        return f"tensor-parallel worker rank {rank} (Ray actor) exited: {why}"

    def _exited_worker(self) -> str | None:
        calls = getattr(self, "calls", [])
        if not calls:
            return None
        done, _ = ray.wait(calls, num_returns=1, timeout=0)
        return self._describe(done[0]) if done else None

    def _wait_for_exit(self) -> str:
        done, _ = ray.wait(self.calls, num_returns=1)
        return self._describe(done[0])

    def _join_workers(self, timeout: float) -> None:
        ray.wait(self.calls, num_returns=len(self.calls), timeout=timeout)

    def _kill_workers(self) -> None:
        if not getattr(self, "_owns_ray", False) and not ray.is_initialized():
            return
        actors = [*getattr(self, "actors", []), getattr(self, "_placeholder", None)]
        group, owns = getattr(self, "_group", None), getattr(self, "_owns_ray", False)
        self.actors, self._placeholder, self._group, self._owns_ray = [], None, None, False

        def clean_up() -> None:
            for actor in actors:
                if actor is not None:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            if group is not None:
                try:
                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - already removed with the cluster
                    pass
            if owns and ray.is_initialized():
                ray.shutdown()  # a local cluster we started ends here; a joined one is left

        # bounded: with the cluster's control process gone these calls retry for a minute,
        # and a stopping server must not wait on them (Ray ends the actors of a driver
        # that has gone anyway)
        cleaner = threading.Thread(target=clean_up, name="ray-cleanup", daemon=True)
        cleaner.start()
        cleaner.join(_CLEANUP_TIMEOUT_S)
        if cleaner.is_alive():
            logger.warning("Ray did not confirm the end of the tensor-parallel actors in "
                           "%.0f s", _CLEANUP_TIMEOUT_S)


def _init_ray() -> None:
    """``ray.init()`` with no address: RAY_ADDRESS, else the cluster last started on this
    host, else a new local one (Ray's own rule, which vLLM relies on too). Called on a
    thread that lives as long as the process: a local cluster's processes are killed when
    the *thread* that started them ends (Linux's parent-death signal), and the engine is
    built on a thread that ends before the executor is shut down."""
    result: queue.Queue[BaseException | None] = queue.Queue()

    def driver() -> None:
        try:
            ray.init(log_to_driver=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.put(exc)
            return
        result.put(None)
        threading.Event().wait()  # never set: stays for the process's lifetime

    threading.Thread(target=driver, name="ray-driver", daemon=True).start()
    error = result.get()
    if error is not None:
        raise error


def _first_index(device_ids: dict[str, list[str]]) -> int:
    """Rank 0's device index, from the IDs Ray gave its placeholder (0 on CPU). Ray's IDs
    number the devices its node process saw: the same as this process when the server
    started the local Ray, or when ``ray start`` ran with the same CUDA_VISIBLE_DEVICES."""
    for ids in device_ids.values():
        if ids and ids[0].isdigit():
            return int(ids[0])
    return 0
