"""Where a long prompt's prefill time goes, per 512-token chunk as the context grows:
attention (the paged kernel, four rows at a time, against the tiled prefill kernel) and the
linears of one SmolLM2-135M layer stack (30 layers, 9 query / 3 KV heads of 64, hidden 576,
MLP 1536), bf16 by default, in one run.

    PYTHONPATH=. python benchmarks/long_prefill.py [--prompt-len 8000] [--chunk 512]
        [--dtype bfloat16] [--iters 3] [--every 4]

Each line is one chunk position (every --every-th chunk, the last one always): median ms of
--iters calls for one layer, times the 30 layers. The totals at the bottom extrapolate the
measured chunks to all of them (linearly between the measured ones). GFLOP/s counts the
causal attention's multiply-adds (QK and PV) as two flops each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from server.cache_dir import writable_cache_dir
from server.hpu.cpu.kernels import load_cpu_kernels

LAYERS, HEADS, KV_HEADS, DIM, HIDDEN, MLP = 30, 9, 3, 64, 576, 1536


def median_ms(fn, iters: int) -> float:  # noqa: ANN001 - a callable
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=8000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="measure every n-th chunk")
    args = parser.parse_args()
    if not load_cpu_kernels(writable_cache_dir() / "kernels"):
        raise SystemExit("the fused CPU kernels did not build")
    ops = torch.ops.hpu_serve
    dtype = getattr(torch, args.dtype)
    block, chunk, total = args.block, args.chunk, args.prompt_len
    blocks = -(-total // block)
    torch.manual_seed(0)
    k_cache = torch.randn(blocks + 1, KV_HEADS, DIM, block, dtype=dtype)  # keys transposed
    v_cache = torch.randn(blocks + 1, KV_HEADS, block, DIM, dtype=dtype)
    table = torch.randperm(blocks, dtype=torch.int32)  # scattered, as after churn
    scale = DIM**-0.5
    weights = [torch.randn(o, HIDDEN, dtype=dtype) * 0.02
               for o in ((HEADS + 2 * KV_HEADS) * DIM, 2 * MLP)]
    weights += [torch.randn(HIDDEN, HEADS * DIM, dtype=dtype) * 0.02,
                torch.randn(HIDDEN, MLP, dtype=dtype) * 0.02]
    starts = list(range(0, total, chunk))
    measured = [s for i, s in enumerate(starts) if i % args.every == 0 or s == starts[-1]]
    print(f"{total}-token prompt in {chunk}-token chunks, {args.dtype}, "
          f"{torch.get_num_threads()} threads; ms for {LAYERS} layers")
    print(f"{'ctx':>6} {'paged attn':>11} {'tiled attn':>11} {'speedup':>8} "
          f"{'tiled GF/s':>11} {'linears':>8}")
    rows = {}
    for start in measured:
        n = min(chunk, total - start)
        lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        tables = table.repeat(n, 1).contiguous()
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, dtype=dtype)
        query = qkv.view(n, -1, DIM)[:, :HEADS]
        paged = median_ms(lambda: ops.decode_attention(query, k_cache, v_cache, tables, lens,
                                                       scale), args.iters) * LAYERS
        tiled = median_ms(lambda: ops.prefill_attention(query, k_cache, v_cache, tables, lens,
                                                        scale), args.iters) * LAYERS
        x = torch.randn(n, HIDDEN, dtype=dtype)
        h = torch.randn(n, HEADS * DIM, dtype=dtype)
        m = torch.randn(n, MLP, dtype=dtype)

        def linears() -> None:
            torch.nn.functional.linear(x, weights[0])
            torch.nn.functional.linear(x, weights[1])
            torch.nn.functional.linear(h, weights[2])
            torch.nn.functional.linear(m, weights[3])

        lin = median_ms(linears, args.iters) * LAYERS
        pairs = n * start + n * (n + 1) / 2
        gflops = 4 * pairs * HEADS * DIM * LAYERS / (tiled / 1e3) / 1e9
        rows[start] = (paged, tiled, lin)
        print(f"{start:>6} {paged:>11.0f} {tiled:>11.0f} {paged / tiled:>7.2f}x "
              f"{gflops:>11.0f} {lin:>8.0f}", flush=True)
    sums = [0.0, 0.0, 0.0]
    for s in starts:  # linear interpolation between the measured chunk positions
        lo = max(m for m in measured if m <= s)
        hi = min(m for m in measured if m >= s)
        w = 0.0 if hi == lo else (s - lo) / (hi - lo)
        for i in range(3):
            sums[i] += rows[lo][i] * (1 - w) + rows[hi][i] * w
    print(f"whole prompt (s): paged attention {sums[0] / 1e3:.1f}, tiled attention "
          f"{sums[1] / 1e3:.1f}, linears {sums[2] / 1e3:.1f}")


if __name__ == "__main__":
    main()
