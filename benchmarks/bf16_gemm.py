"""The bf16 small-batch linear kernel (torch.ops.hpu_serve.bf16_linear) per row count,
against oneDNN's packed bf16 GEMM, on SmolLM2-135M's linear stack and LM head (CPU).

    python benchmarks/bf16_gemm.py [--rows 1,2,4,6,8,12,16] [--layers 30] [--threads 2]
        [--repeats 15]

Each layer gets its own random weights (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), so the weights stream from memory as in serving; the LM head is 49152x576.
Prints the best-of-``--repeats`` milliseconds of one pass for each path and the kernel's
read rate over the stack. With ``--threads 1`` times are the thread's CPU time, which other
processes on a shared host disturb less than wall time; more threads: wall time. The
serving threshold (``server/hpu/cpu/linear.py`` BF16_KERNEL_MAX_ROWS) is one pass's rows.
Also checks, on every row count, that each row's output equals its one-row call's bits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_gemm import best_ms  # noqa: E402

from server.cache_dir import writable_cache_dir  # noqa: E402
from server.hpu.cpu.bf16_pack import bf16_kernel_available, bf16_linear, pack_bf16  # noqa: E402
from server.hpu.cpu.kernels import load_cpu_kernels  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
HEAD = (49152, 576)


def layer(n: int, k: int, gen: torch.Generator) -> dict:
    weight = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    return {"k": k, "kernel": pack_bf16(weight),
            "dense": torch.ops.mkldnn._reorder_linear_weight(weight, 1)}


def onednn(x: torch.Tensor, w: dict) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w["dense"], None, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,6,8,12,16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not load_cpu_kernels(writable_cache_dir() / "kernels") or not bf16_kernel_available():
        sys.exit("the fused CPU kernels did not build here")
    gen = torch.Generator().manual_seed(0)
    stack = [layer(n, k, gen) for _ in range(args.layers) for n, k in SHAPES]
    head = layer(*HEAD, gen)
    stack_bytes = sum(w["kernel"].weight.numel() * 2 for w in stack)
    cpu_time = args.threads == 1
    print(f"{args.layers} layers ({stack_bytes / 2**20:.0f} MiB) + LM head, {args.threads} "
          f"thread(s), {'thread CPU' if cpu_time else 'wall'} time, ms per pass")
    print(f"{'rows':>4} {'kernel':>8} {'GB/s':>6} {'oneDNN':>8} {'head kernel':>12} "
          f"{'head oneDNN':>12}  rows' bits = one-row calls'")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}
            kernel = best_ms(lambda: [bf16_linear(xs[w["k"]], w["kernel"]) for w in stack],
                             args.repeats, cpu_time)
            dense = best_ms(lambda: [onednn(xs[w["k"]], w) for w in stack], args.repeats,
                            cpu_time)
            head_kernel = best_ms(lambda: bf16_linear(xs[576], head["kernel"]), args.repeats,
                                  cpu_time)
            head_dense = best_ms(lambda: onednn(xs[576], head), args.repeats, cpu_time)
            x = xs[576]
            invariant = all(torch.equal(bf16_linear(x, w["kernel"], torch.float32)[r],
                                        bf16_linear(x[r:r + 1], w["kernel"], torch.float32)[0])
                            for w in (stack[0], head) for r in range(rows))
            print(f"{rows:>4} {kernel:>8.2f} {stack_bytes / kernel / 1e6:>6.1f} {dense:>8.2f} "
                  f"{head_kernel:>12.2f} {head_dense:>12.2f}  {invariant}", flush=True)


if __name__ == "__main__":
    main()
