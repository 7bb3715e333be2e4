"""The int4 linear kernel (torch.ops.hpu_serve.int4_linear) per row count, against aten's
int4 kernel and the oneDNN-packed bfloat16 weight, on SmolLM2-135M's linear stack (CPU).

    python benchmarks/int4_gemm.py [--rows 1,2,3,4,5,8,9,12,16,24,32] [--layers 30]
        [--threads 1] [--repeats 7]

Each layer gets its own random weights (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; groups of 32, a zero per group as in Q4_1), so the weights stream from memory as
in serving. Prints the best-of-``--repeats`` milliseconds of one pass over all layers for
each path, and for the kernel its cost relative to one row. With ``--threads 1`` (the
default) times are the thread's CPU time, which other processes on a shared host disturb
less than wall time; more threads: wall time. The serving threshold
(``server/hpu/cpu/linear.py`` INT4_KERNEL_MAX_ROWS) is the row count up to which the
kernel beats the dense weight.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.cache_dir import writable_cache_dir  # noqa: E402
from server.hpu.cpu.int4_pack import int4_kernel_available, int4_linear, pack_int4  # noqa: E402
from server.hpu.cpu.kernels import load_cpu_kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
GROUP = 32


def build(layers: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    stack = []
    for _ in range(layers):
        for n, k in SHAPES:
            codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
            scale = torch.rand(n, k // GROUP, generator=gen) * 0.01
            zero = (torch.rand(n, k // GROUP, generator=gen) - 0.5) * 0.01
            dense = ((codes - 8) * scale.repeat_interleave(GROUP, 1)
                     + zero.repeat_interleave(GROUP, 1)).bfloat16()
            stack.append({
                "k": k,
                "aten": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                "scale_zero": torch.stack([scale.t(), zero.t()], -1).bfloat16().contiguous(),
                "kernel": pack_int4(codes, scale, zero),
                "dense": torch.ops.mkldnn._reorder_linear_weight(dense, 1),
            })
    return stack


def best_ms(fn: Callable[[], object], repeats: int, cpu_time: bool) -> float:
    clock = time.thread_time if cpu_time else time.perf_counter
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        began = clock()
        fn()
        best = min(best, clock() - began)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8,9,12,16,24,32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not load_cpu_kernels(writable_cache_dir() / "kernels") or not int4_kernel_available():
        sys.exit("the fused CPU kernels did not build here")
    stack = build(args.layers)
    cpu_time = args.threads == 1
    print(f"{args.layers} layers, {args.threads} thread(s), "
          f"{'thread CPU' if cpu_time else 'wall'} time, ms per pass")
    print(f"{'rows':>4} {'aten int4':>10} {'kernel':>8} {'x 1 row':>8} {'dense bf16':>11}")
    one_row = 0.0
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
            aten = best_ms(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(
                xs[w["k"]], w["aten"], GROUP, w["scale_zero"]) for w in stack],
                args.repeats, cpu_time)
            kernel = best_ms(lambda: [int4_linear(xs[w["k"]], w["kernel"]) for w in stack],
                             args.repeats, cpu_time)
            dense = best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(
                xs[w["k"]], w["dense"], None, "none", [], "") for w in stack],
                args.repeats, cpu_time)
            one_row = one_row or kernel
            print(f"{rows:>4} {aten:>10.2f} {kernel:>8.2f} {kernel / one_row:>8.2f} "
                  f"{dense:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
