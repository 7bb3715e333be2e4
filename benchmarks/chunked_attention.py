"""Decode attention of one Llama-4-Scout-shaped layer (40 query heads, 8 KV heads of 128,
bf16) with and without a chunk, on the fused CPU kernel and on the PyTorch flat path, in one
run: the kernel reads only the blocks of a row's chunk, the PyTorch path masks the rest.

    python benchmarks/chunked_attention.py [--ctx 4096] [--chunk 1024] [--batch 4]

Each row's query sits in the middle of its last chunk (ctx % chunk == chunk / 2 by default:
ctx is rounded so). Each line is the median of --iters calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from server.cache_dir import writable_cache_dir
from server.hpu.attention import AttentionMetadata, flat_paged_attention
from server.hpu.cpu.kernels import load_cpu_kernels
from server.hpu.cpu.layer_ops import FusedCpuLayerOps


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
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not load_cpu_kernels(writable_cache_dir() / "kernels"):
        raise SystemExit("the fused CPU kernels did not build")
    fused = FusedCpuLayerOps()
    heads, kv_heads, dim, block, bs = 40, 8, 128, args.block, args.batch
    ctx = args.ctx // args.chunk * args.chunk + args.chunk // 2  # mid-chunk queries
    per_row = -(-ctx // block)
    num_blocks = bs * per_row
    torch.manual_seed(0)
    k_cache = torch.randn(num_blocks + 1, kv_heads, block, dim, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    keys_t = k_cache.transpose(2, 3).contiguous()  # the kernel's key layout
    query = torch.randn(bs, heads, dim, dtype=torch.bfloat16)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(bs, per_row)
    kernel_meta = AttentionMetadata(False, block, torch.zeros(bs, dtype=torch.long),
                                    block_tables=tables,
                                    seq_lens=torch.full((bs,), ctx, dtype=torch.int32))
    groups = torch.arange(bs).repeat_interleave(per_row)
    used = torch.tensor([block] * (per_row - 1) + [(ctx - 1) % block + 1]).repeat(bs)
    flat_meta = AttentionMetadata(
        False, block, torch.zeros(bs, dtype=torch.long), block_list=torch.arange(num_blocks),
        block_groups=groups,
        block_mapping=torch.nn.functional.one_hot(groups, bs).to(torch.bfloat16),
        block_bias=torch.where(torch.arange(block) < used.view(-1, 1), 0.0, -1e30),
        block_start=(torch.arange(per_row) * block - (ctx - 1)).repeat(bs))
    scale = dim**-0.5
    for chunk in (None, args.chunk):
        kernel = median_ms(lambda: fused.decode_attention(
            query, (keys_t, v_cache), kernel_meta, scale, chunk=chunk), args.iters)
        flat = median_ms(lambda: flat_paged_attention(
            query, k_cache, v_cache, flat_meta, scale, chunk=chunk), args.iters)
        what = f"chunk {chunk}" if chunk else "no chunk"
        print(f"batch {bs}, ctx {ctx}, {what}: fused kernel {kernel:.2f} ms, PyTorch flat "
              f"{flat:.2f} ms per layer", flush=True)


if __name__ == "__main__":
    main()
