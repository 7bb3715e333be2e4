"""Warmup time, bucket counts and decode step latency: compiled graphs vs eager, one run.

    python benchmarks/execution_modes.py [--model PATH] [--batch-sizes 1 8 32] [--ctx 256]

Uses a bucket file covering exactly the measured shapes, so warmup compiles only what is
timed. Prints per-batch decode step latency of both modes and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from server import LLM, SamplingParams


def decode_step_ms(llm: LLM, bs: int, ctx: int, steps: int) -> float:
    """Median wall time of one engine step while `bs` sequences decode."""
    engine = llm.engine
    prompt = [7] * ctx
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(bs):
        engine.add_request(f"b{bs}-{i}", prompt, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
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
    args = parser.parse_args()

    blocks_per_seq = -(-(args.ctx + args.steps + 2) // args.block_size)
    max_bs = max(args.batch_sizes)
    lines = [f"(1, {-(-args.ctx // args.block_size) * args.block_size}, 0)"]
    lines += [f"({bs}, 1, {bs * blocks_per_seq})" for bs in args.batch_sizes]
    bucket_file = Path(tempfile.mkdtemp()) / "buckets.txt"
    bucket_file.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, VLLM_BUCKETING_FROM_FILE=str(bucket_file))
    common = dict(dtype=args.dtype, max_num_seqs=max_bs, block_size=args.block_size,
                  max_model_len=args.block_size * blocks_per_seq, environ=env)

    results = {}
    for mode in ("eager", "compile"):
        start = time.perf_counter()
        llm = LLM(args.model, execution_mode=mode, **common)
        ready = time.perf_counter() - start
        shapes = llm.engine.runner.shapes
        planned = sum(len(b) for b in shapes.buckets.values()) if shapes else 0
        compiles = llm.engine.counters.compilations(stage="warmup")
        steps = {bs: decode_step_ms(llm, bs, args.ctx, args.steps) for bs in args.batch_sizes}
        serving = llm.engine.counters.compilations(stage="serving")
        results[mode] = steps
        print(f"{mode:>8}: load+warmup {ready:6.1f} s, buckets {planned}, "
              f"warmup compilations {compiles}, compilations while serving {serving}")
        del llm
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, ctx {args.ctx}")
    print(f"{'batch':>5} {'eager ms/step':>14} {'compiled ms/step':>17} {'eager/compiled':>15}")
    for bs in args.batch_sizes:
        e, c = results["eager"][bs], results["compile"][bs]
        print(f"{bs:>5} {e:>14.1f} {c:>17.1f} {e / c:>15.2f}")


if __name__ == "__main__":
    main()
