"""Decode speed as a fraction of this machine's own ceilings, all measured in one run.

    python benchmarks/roofline.py [--model PATH] [--ctx 200] [--batch 32] [--threads 1]

On a machine shared with other jobs, ``--threads 1`` times steps by the CPU time of the one
thread (the ceilings are best-of-10 runs on that thread): with more threads than idle cores
each of a step's ~250 parallel regions waits for a descheduled thread, and wall time then
measures the neighbours. Compare branches side by side, never across runs.

- bf16 matmul ceiling: best GFLOP/s of a large square bf16 matmul (plain or oneDNN-packed).
- memory bandwidth: best GB/s of a large tensor copy (bytes read), and of a large sum (reads
  only: the stricter ceiling, also reported), each the better of 4 KiB and 2 MiB pages; the
  read one also the bf16 small-batch kernel's rate on a 512 MiB weight.
- batch-N decode (compute-bound regime): achieved GFLOP/s of the engine's decode step
  (2 x params FLOPs per token for the linear layers + attention over the context) / ceiling.
- batch-1 decode (bandwidth-bound regime): bytes a token must read (weights as the step reads
  them, i.e. a GGUF's 4-bit codes where small batches use them, + its KV) divided by the
  measured bandwidth, i.e. the fastest possible step, / the measured step time.
"""

from __future__ import annotations

import argparse
import time

import torch
from execution_modes import decode_step_ms
from torch import nn

from server import LLM
from server.hpu.cpu.bf16_pack import bf16_kernel_available, bf16_linear, pack_bf16
from server.hpu.cpu.host_memory import empty_on_huge_pages
from server.hpu.cpu.linear import (
    PackedLinear,
    SmallBatchInt4Linear,
    SmallBatchQ8Linear,
    packing_supported,
)


def best_time(fn, repeat: int) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def matmul_ceiling_gflops(n: int = 2048) -> float:
    """Best of a plain bf16 matmul and the oneDNN-packed linear the engine runs on CPU
    (the packed one is the faster: measuring only ``a @ b`` would understate the ceiling)."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    best = best_time(lambda: a @ b, 10)
    if packing_supported(torch.bfloat16):
        packed = PackedLinear(nn.Linear(n, n, bias=False, dtype=torch.bfloat16))
        best = min(best, best_time(lambda: packed(a), 10))
    return 2 * n**3 / best / 1e9


def buffers(mib: int) -> list[torch.Tensor]:
    """Two 1.0-filled float32 buffers of ``mib`` MiB: one on the allocator's 4 KiB pages, one
    on 2 MiB pages (which the engine's packed weights and KV caches ask for, and which read
    faster): the ceiling is the better of the two."""
    n = mib * 2**20 // 4
    return [torch.ones(n), empty_on_huge_pages((n,), torch.float32).fill_(1.0)]


def copy_bandwidth_gbs(mib: int = 512) -> float:
    best = 0.0
    for src in buffers(mib):
        dst = empty_on_huge_pages(tuple(src.shape), src.dtype)
        best = max(best, src.numel() * 4 / best_time(lambda: dst.copy_(src), 10) / 1e9)
    return best


def read_bandwidth_gbs(mib: int = 512) -> float:
    """Best GB/s of reading a large tensor: a reduction over it on either page size, and the
    bf16 small-batch kernel streaming it as a one-row GEMV's weight (on 2 cores the sum is
    bound by its adds near 35 GB/s while the kernel has read 50: the ceiling is the best)."""
    best = max(src.numel() * 4 / best_time(lambda: src.sum(), 10) / 1e9  # noqa: B023
               for src in buffers(mib))
    if bf16_kernel_available():
        weight = pack_bf16(torch.ones(mib * 2**20 // 2 // 4096, 4096, dtype=torch.bfloat16))
        x = torch.ones(1, 4096, dtype=torch.bfloat16)
        best = max(best, mib * 2**20 / best_time(lambda: bf16_linear(x, weight), 10) / 1e9)
    return best


def batch1_weight_bytes(model: nn.Module, element: int) -> int:
    """Bytes of weights one batch-1 decode step reads: 4-bit (or a Q8_0 head's 8-bit) codes +
    scales where a layer serves small batches from them, the dense weight elsewhere."""
    int4 = [m for m in model.modules() if isinstance(m, SmallBatchInt4Linear)]
    q8 = [m for m in model.modules() if isinstance(m, SmallBatchQ8Linear)]  # a Q8_0 head
    wrapped = {id(m.dense) for m in int4 + q8}
    total = sum(t.numel() * t.element_size() for m in int4
                for t in ((m.packed.weight,) if m.packed is not None  # our kernel's blocks
                          else (m.int4_weight, m.scale_zero)))
    total += sum(m.packed.weight.numel() for m in q8)
    for m in model.modules():
        if isinstance(m, (PackedLinear, nn.Linear)) and id(m) not in wrapped:
            total += (m.weight_numel if isinstance(m, PackedLinear) else m.weight.numel()) * element
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ctx", type=int, default=200, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; 1 also times steps by thread CPU time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    llm = LLM(args.model, max_num_seqs=args.batch, block_size=128,
              max_model_len=args.ctx + args.steps + 130)
    model = llm.engine.runner.model
    cfg = model.config
    element = next(model.parameters()).element_size()
    # Every matmul weight, the LM head included (tied or not); packed ones keep their count.
    linear_params = sum(m.weight_numel if isinstance(m, PackedLinear) else m.weight.numel()
                        for m in model.modules() if isinstance(m, (PackedLinear, nn.Linear)))
    ctx = args.ctx + args.steps // 2  # mean context while measuring
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element * ctx
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx

    ceiling = matmul_ceiling_gflops()
    bandwidth = copy_bandwidth_gbs()
    read_bandwidth = read_bandwidth_gbs()
    step_n = decode_step_ms(llm, args.batch, args.ctx, args.steps, clock) / 1000
    step_1 = decode_step_ms(llm, 1, args.ctx, args.steps, clock) / 1000
    achieved = args.batch * (2 * linear_params + attn_flops) / step_n / 1e9
    bytes_1 = batch1_weight_bytes(model, element) + kv_per_token
    floor_1 = bytes_1 / (bandwidth * 1e9)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"dtype {next(model.parameters()).dtype}, linear params {linear_params / 1e6:.1f}M")
    print(f"bf16 matmul ceiling        {ceiling:8.1f} GFLOP/s (2048^3, best of plain / packed)")
    print(f"copy bandwidth             {bandwidth:8.1f} GB/s (512 MiB, bytes read)")
    print(f"read bandwidth             {read_bandwidth:8.1f} GB/s (512 MiB sum)")
    print(f"decode batch {args.batch:<3}          {step_n * 1000:8.1f} ms/step  "
          f"{args.batch / step_n:7.1f} tok/s  {achieved:7.1f} GFLOP/s = "
          f"{achieved / ceiling:.2f} of the matmul ceiling")
    print(f"decode batch 1             {step_1 * 1000:8.1f} ms/step  {1 / step_1:7.1f} tok/s  "
          f"floor {floor_1 * 1000:.1f} ms ({bytes_1 / 1e6:.0f} MB at {bandwidth:.1f} GB/s) = "
          f"{floor_1 / step_1:.2f} of the copy-bandwidth ceiling, "
          f"{bytes_1 / (read_bandwidth * 1e9) / step_1:.2f} of the read-bandwidth one")


if __name__ == "__main__":
    main()
