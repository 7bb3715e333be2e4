"""Executors: how the tensor-parallel ranks 1..N-1 are started, watched and stopped.

``base`` holds what every backend shares (the rendezvous, the orders rank 0 broadcasts, the
rank loop of the workers); ``mp`` starts them as local processes, ``ray`` as Ray actors.
"""

from __future__ import annotations

from server.config import EngineConfig
from server.engine.executor.base import FaultListener, RankExecutor
from server.engine.executor.mp import MultiprocExecutor
from server.hpu.platform import Platform

__all__ = ["FaultListener", "RankExecutor", "make_executor"]


def make_executor(config: EngineConfig, platform: Platform,
                  on_fault: FaultListener | None = None) -> RankExecutor:
    """The executor of ``--distributed-executor-backend`` (ray imported only when chosen:
    it is an optional dependency); ``on_fault``: called if a worker rank dies."""
    if config.parallel.distributed_executor_backend == "ray":
        from server.engine.executor.ray import RayExecutor

        return RayExecutor(config, platform, on_fault)
    return MultiprocExecutor(config, platform, on_fault)
