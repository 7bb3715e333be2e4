"""The tensor-parallel process group and the few collectives the model and engine use.

Every rank is one process: on this host (the mp executor), or a Ray actor on any node of a
Ray cluster; they meet at a TCP store that rank 0 opens (on loopback, or at the address of
rank 0's node for Ray). The backend is the platform's (``Platform.dist_backend``: hccl on
Gaudi, nccl on CUDA, gloo on CPU). At world size 1 no group exists and every collective
returns its input untouched, so single-device serving runs exactly the code it ran before.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CommStats:
    """Wall time spent inside collectives (measured only while ``enabled``: timing a
    device collective needs a synchronisation that serving should not pay)."""

    enabled: bool = False
    seconds: float = 0.0  # all-reduces and gathers inside the forward
    calls: int = 0
    broadcast_seconds: float = 0.0  # rank 0's step orders (broadcast_object)

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.broadcast_seconds = 0.0


@dataclass(slots=True)
class ParallelContext:
    """One rank's view of the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # torch.distributed ProcessGroup, None at world size 1
    stats: CommStats = field(default_factory=CommStats)

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, samples, and tells the others what to run."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks in place (row-parallel layers' partial sums)."""
        if self.world_size == 1:
            return tensor
        start = self._start()
        dist.all_reduce(tensor, group=self.group)
        self._stop(start)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's ``tensor`` along its last dimension, rank order
        (vocab-parallel logits: each rank computed its slice of the vocabulary)."""
        if self.world_size == 1:
            return tensor
        start = self._start()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        self._stop(start)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (ranks must agree on cache sizes)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; CPU tensors travel inside it). Uses the
        group's own backend, so on a device backend the bytes make a round trip through
        device memory: small per step (a step's inputs are a few KiB)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.is_driver else None]
        start = self._start()
        dist.broadcast_object_list(box, src=0, group=self.group, device=self._object_device())
        if self.stats.enabled:
            self.stats.broadcast_seconds += time.perf_counter() - start
        return box[0]

    def _object_device(self) -> torch.device | None:
        # gloo moves CPU tensors; nccl/hccl want the rank's own device
        return None if self.device.type == "cpu" else self.device

    def _start(self) -> float:
        return time.perf_counter() if self.stats.enabled else 0.0

    def _stop(self, start: float) -> None:
        if self.stats.enabled:
            self.stats.seconds += time.perf_counter() - start
            self.stats.calls += 1


SINGLE = ParallelContext()  # world size 1: what every caller gets when it passes none


def free_port() -> int:
    """A TCP port unused on every interface, for the rendezvous store (under Ray, ranks on
    other hosts reach it at the node's address, not loopback)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_parallel(rank: int, world_size: int, port: int, backend: str, device: torch.device,
                  timeout_s: float) -> ParallelContext:
    """Joins the group (blocks until every rank has); rank 0 hosts the TCP store."""
    if world_size == 1:
        return ParallelContext(device=device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(rank, world_size, device, dist.group.WORLD)


def close_parallel(ctx: ParallelContext) -> None:
    """Leaves the group, so that a later engine in this process can form a new one."""
    if ctx.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def tensors_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (dataclass fields, tuples, lists) moved to
    ``device``: step inputs are pickled from host memory and rebuilt on each rank's device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: tensors_to(getattr(obj, f.name), device) for f in fields(obj)
                   if f.init}
        new = replace(obj, **changes)
        return new
    if isinstance(obj, (tuple, list)):
        return type(obj)(tensors_to(x, device) for x in obj)
    return obj

