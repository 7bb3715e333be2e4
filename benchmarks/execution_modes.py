"""Warmup time, bucket counts and decode step latency of the CPU execution modes, one run:
eager with the fused kernels (the default), eager with plain PyTorch ops
(HPU_SERVE_CPU_KERNELS=0) and static-shape compiled graphs.

    python benchmarks/execution_modes.py [--model PATH] [--batch-sizes 1 8 32] [--ctx 256]

Uses a bucket file covering exactly the measured shapes, so warmup compiles only what is
timed. Each mode's step latency is the median over --rounds rounds taken in turn (A/B/C,
then C/B/A...), so drifts of a noisy machine hit every mode alike. Prints ratios to the
default.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from server import LLM, SamplingParams


def decode_step_ms(llm: LLM, bs: int, ctx: int, steps: int,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of one engine step while `bs` sequences decode: wall time, or with
    ``clock=time.thread_time`` and one thread the CPU time the step itself took (what a
    shared, oversubscribed machine does not inflate)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(bs):
        # a prompt of its own per sequence: shared ones would share their KV blocks through
        # the prefix cache, and a batch's attention would read one sequence's KV from cache
        engine.add_request(f"b{bs}-{i}", [7 + i] * ctx, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills
    times = []
    for _ in range(steps):
        start = clock()
        engine.step()
        times.append(clock() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--ctx", type=int, default=256, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    blocks_per_seq = -(-(args.ctx + args.steps + 2) // args.block_size)
    max_bs = max(args.batch_sizes)
    lines = [f"(1, {-(-args.ctx // args.block_size) * args.block_size}, 0)"]
    lines += [f"({bs}, 1, {bs * blocks_per_seq})" for bs in args.batch_sizes]
    bucket_file = Path(tempfile.mkdtemp()) / "buckets.txt"
    bucket_file.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, VLLM_BUCKETING_FROM_FILE=str(bucket_file))
    common = dict(dtype=args.dtype, max_num_seqs=max_bs, block_size=args.block_size,
                  max_model_len=args.block_size * blocks_per_seq)

    modes = {
        "eager": ("eager", {"HPU_SERVE_CPU_KERNELS": "1"}),
        "eager-torch-ops": ("eager", {"HPU_SERVE_CPU_KERNELS": "0"}),
        "compile": ("compile", {}),
    }
    llms = {}
    for name, (mode, extra) in modes.items():
        start = time.perf_counter()
        llm = LLM(args.model, execution_mode=mode, **{**common, "environ": {**env, **extra}})
        ready = time.perf_counter() - start
        shapes = llm.engine.runner.shapes
        planned = sum(len(b) for b in shapes.buckets.values()) if shapes else 0
        compiles = llm.engine.counters.compilations(stage="warmup")
        print(f"{name:>16}: load+warmup {ready:6.1f} s, buckets {planned}, "
              f"warmup compilations {compiles}", flush=True)
        llms[name] = llm
    steps: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batch_sizes}
                                                for n in llms}
    for rnd in range(args.rounds):
        order = list(llms) if rnd % 2 == 0 else list(llms)[::-1]
        for bs in args.batch_sizes:
            for name in order:
                steps[name][bs].append(decode_step_ms(llms[name], bs, args.ctx, args.steps))
    for name, llm in llms.items():
        serving = llm.engine.counters.compilations(stage="serving")
        print(f"{name:>16}: compilations while serving {serving}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, ctx {args.ctx}, "
          f"median of {args.rounds} rounds")
    print(f"{'batch':>5} " + " ".join(f"{n + ' ms':>19}" for n in llms)
          + " " + " ".join(f"{n + ' / eager':>25}" for n in list(llms)[1:]))
    for bs in args.batch_sizes:
        med = {n: statistics.median(steps[n][bs]) for n in llms}
        print(f"{bs:>5} " + " ".join(f"{med[n]:>19.1f}" for n in llms) + " "
              + " ".join(f"{med[n] / med['eager']:>25.2f}" for n in list(llms)[1:]))


if __name__ == "__main__":
    main()
