"""Warmup on a fake graph runner: every bucket warmed, graphs captured within the memory
budget, the sampler warmed once per distinct code path, counters moved to serving."""

from __future__ import annotations

import torch

from server.config import ExecutionMode, WarmupConfig
from server.hpu.counters import DeviceCounters
from server.hpu.graph_runner import EagerRunner, ForwardInputs, GraphRunner
from server.hpu.types import Bucket, Phase, Stage, SyncPoint
from server.hpu.warmup import SAMPLER_CONFIGS, WarmupHooks, distinct_sampler_paths, run_warmup

GiB = 1 << 30
BUCKETS = {Phase.PREFILL: [Bucket(1, 128, 0), Bucket(2, 128, 0), Bucket(1, 256, 0)],
           Phase.DECODE: [Bucket(1, 1, 4), Bucket(2, 1, 8), Bucket(4, 1, 16), Bucket(8, 1, 32)]}


class CapturingRunner(GraphRunner):
    """Each capture takes 1 GiB of "device memory"."""

    mode = ExecutionMode.GRAPHS
    description = "fake graphs"
    captures_graphs = True

    def __init__(self, memory: list[int]) -> None:
        super().__init__(lambda inputs: torch.zeros(1), DeviceCounters("m"))
        self.memory = memory
        self.ran: list[tuple[Phase, Bucket]] = []
        self.captured: list[tuple[Phase, Bucket]] = []

    def run(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> torch.Tensor:
        self.ran.append((phase, bucket))
        return torch.zeros(1)

    def capture(self, phase: Phase, bucket: Bucket, inputs: ForwardInputs) -> None:
        self.memory[0] -= GiB
        self.captured.append((phase, bucket))

    def can_replay(self, phase: Phase, bucket: Bucket) -> bool:
        return (phase, bucket) in self.captured


def hooks(memory: list[int], sampled: list[tuple[int, tuple]]) -> WarmupHooks:
    return WarmupHooks(make_inputs=lambda phase, bucket: None,  # type: ignore[arg-type, return-value]
                       run_sampler=lambda bs, config: sampled.append((bs, config)),
                       free_memory=lambda: memory[0])


def test_buckets_warmed_then_captured_within_the_budget() -> None:
    memory = [20 * GiB]
    runner = CapturingRunner(memory)
    sampled: list[tuple[int, tuple]] = []
    # 0.5 of 20 GiB for graphs: 3 GiB for prompt graphs (ratio 0.3), 7 GiB for decode
    cfg = WarmupConfig(graph_reserved_mem=0.5, graph_prompt_ratio=0.3)
    run_warmup(BUCKETS, runner, hooks(memory, sampled), runner.counters, cfg)
    assert sorted(runner.ran) == sorted((p, b) for p in Phase for b in BUCKETS[p])
    assert sorted(b for p, b in runner.captured if p is Phase.PREFILL) == sorted(BUCKETS[Phase.PREFILL])
    decode = [b for p, b in runner.captured if p is Phase.DECODE]
    assert decode == [(8, 1, 32), (4, 1, 16), (2, 1, 8), (1, 1, 4)]  # max_bs: largest first
    assert runner.can_replay(Phase.DECODE, (8, 1, 32))
    assert runner.counters.stage == "serving"
    assert runner.counters.compilations(stage="serving") == 0
    # each bucket's warmup cost was measured (what a warmup-time budget is made of)
    for phase in Phase:
        assert sorted(runner.counters.observed.warmup_seconds(phase)) == sorted(BUCKETS[phase])


def test_the_budget_stops_capture() -> None:
    memory = [4 * GiB]
    runner = CapturingRunner(memory)
    cfg = WarmupConfig(graph_reserved_mem=0.5, graph_prompt_ratio=0.5)  # 1 GiB per phase
    run_warmup(BUCKETS, runner, hooks(memory, []), runner.counters, cfg)
    assert [b for p, b in runner.captured if p is Phase.DECODE] == [(8, 1, 32)]
    assert not runner.can_replay(Phase.DECODE, (1, 1, 4))


def test_plain_eager_skips_warmup() -> None:
    runner = EagerRunner(lambda inputs: torch.zeros(1), DeviceCounters("m"))
    sampled: list[tuple[int, tuple]] = []
    assert run_warmup(BUCKETS, runner, hooks([0], sampled), runner.counters, WarmupConfig()) == 0
    assert sampled == []
    assert runner.counters.stage == "serving"


def test_sampler_warms_each_code_path_once_per_batch_size() -> None:
    paths = distinct_sampler_paths(SAMPLER_CONFIGS)
    signatures = {(t == 0, p < 1, k > 0) for t, p, k in paths}
    assert len(paths) == len(signatures) == 4  # greedy, plain, top-p, top-p + top-k
    assert {(t == 0, p < 1, k > 0) for t, p, k in SAMPLER_CONFIGS} == signatures
    memory = [8 * GiB]
    sampled: list[tuple[int, tuple]] = []
    runner = CapturingRunner(memory)
    run_warmup(BUCKETS, runner, hooks(memory, sampled), runner.counters, WarmupConfig())
    assert sorted({bs for bs, _ in sampled}) == [1, 2, 4, 8]
    assert len(sampled) == 4 * len(paths)


def test_a_bucket_added_while_serving_counts_as_warmup_then_serving_resumes() -> None:
    counters = DeviceCounters("m")
    counters.serving()
    try:
        with counters.warming():
            counters.compiled(Phase.DECODE)
            raise RuntimeError("the compile failed")
    except RuntimeError:
        pass
    counters.compiled(SyncPoint.SAMPLER)
    assert counters.stage is Stage.SERVING
    assert counters.compilations(Phase.DECODE, Stage.WARMUP) == 1
    assert counters.compilations("sampler", "serving") == 1  # the label values
