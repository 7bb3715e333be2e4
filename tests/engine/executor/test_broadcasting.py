"""Rank 0's broadcasting graph runner: it orders, then runs; its nature is its inner
runner's, read through, never copied."""

from __future__ import annotations

from typing import Any

import torch

from server.config import ExecutionMode
from server.engine.executor.base import BroadcastingRunner, Op, Order
from server.hpu.attention import AttentionMetadata
from server.hpu.counters import DeviceCounters
from server.hpu.distributed import ParallelContext
from server.hpu.graph_runner import EagerRunner, ForwardInputs, GraphRunner
from server.hpu.types import Bucket, Phase, SyncPoint


class RecordingParallel(ParallelContext):
    """A one-rank group that keeps what rank 0 broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Any] = []

    def broadcast_object(self, obj: Any = None) -> Any:
        self.sent.append(obj)
        return obj


class FakeGraphs(GraphRunner):
    mode = ExecutionMode.GRAPHS
    description = "fake graphs"
    captures_graphs = True

    def __init__(self) -> None:
        super().__init__(lambda inputs: torch.zeros(1), DeviceCounters("m"))
        self.calls: list[str] = []

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        self.calls.append("run")
        return torch.ones(1)

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self.calls.append("capture")

    def sync(self, point: SyncPoint) -> None:
        self.calls.append(str(point))


def inputs() -> ForwardInputs:
    ids = torch.zeros(1, 1, dtype=torch.long)
    return ForwardInputs(ids, ids, AttentionMetadata(False, 16, ids.reshape(-1)),
                         torch.zeros(1, dtype=torch.long), 1)


def test_nature_is_the_inner_runners() -> None:
    for inner in (EagerRunner(lambda i: torch.zeros(1), DeviceCounters("m")), FakeGraphs()):
        outer = BroadcastingRunner(inner, RecordingParallel())
        assert (outer.mode, outer.description, outer.needs_warmup, outer.captures_graphs) == (
            inner.mode, inner.description, inner.needs_warmup, inner.captures_graphs)
        assert outer.warmed is inner.warmed


def test_every_call_is_ordered_then_run() -> None:
    inner, parallel = FakeGraphs(), RecordingParallel()
    outer = BroadcastingRunner(inner, parallel)
    bucket = Bucket(1, 1, 0)
    assert outer.run(Phase.PREFILL, bucket, inputs()).item() == 1
    outer.warm(Phase.PREFILL, bucket, inputs())
    outer.capture(Phase.DECODE, bucket, inputs())
    outer.sync(SyncPoint.SAMPLER)
    assert [(o.op, o.phase, o.bucket) for o in parallel.sent] == [
        (Op.RUN, Phase.PREFILL, bucket), (Op.WARM, Phase.PREFILL, bucket),
        (Op.CAPTURE, Phase.DECODE, bucket)]
    assert all(isinstance(o, Order) for o in parallel.sent)
    assert inner.calls == ["run", "run", "capture", "sampler"]  # warm runs once
    assert inner.warmed[Phase.PREFILL] == {bucket}
