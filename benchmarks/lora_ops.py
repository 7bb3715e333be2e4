"""The batched LoRA op, three ways, against the base linear it rides on (CPU).

    python benchmarks/lora_ops.py [--slots 4] [--rank 16] [--dtype bfloat16]

For each projection site of a SmolLM2-135M-sized layer (qkv, o, gate_up, down) and a decode
(16 rows) and a prefill (256 rows) batch whose rows are spread over ``--slots`` adapters,
prints milliseconds per call of: the base linear alone; ``dense`` (every slot's shrink as one
GEMM, a one-hot mask, one expand GEMM: static shapes); ``gather`` (each row's A and B
gathered, two bmm: static shapes); ``grouped`` (rows sorted by slot, a matmul pair per
adapter present: data-dependent shapes, eager only). The model uses the fastest static one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.models.lora.ops import lora_dense, lora_gather, lora_grouped, slot_mask  # noqa: E402

# (name, inputs, outputs, parts) of SmolLM2-135M: hidden 576, 9 heads + 3 KV heads of 64
SITES = [("qkv", 576, 960, 3), ("o", 576, 576, 1), ("gate_up", 576, 3072, 2),
         ("down", 1536, 576, 1)]


def per_call_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    began = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - began) / repeat * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.slots} slots, rank {args.rank}, "
          f"{args.dtype}; ms per call")
    print(f"{'site':8} {'rows':>5} {'base':>8} {'dense':>8} {'gather':>8} {'grouped':>8}")
    totals = {"base": 0.0, "dense": 0.0, "gather": 0.0, "grouped": 0.0}
    for rows in (16, 256):
        for name, inputs, outputs, parts in SITES:
            width = parts * args.rank
            weight = torch.randn(outputs, inputs, dtype=dtype)
            a = torch.randn(args.slots + 1, width, inputs, dtype=dtype)
            bt = torch.randn(args.slots + 1, width, outputs, dtype=dtype)
            a[0], bt[0] = 0, 0
            x = torch.randn(rows, inputs, dtype=dtype)
            slots = torch.arange(rows) % (args.slots + 1)  # every slot and some base rows
            mask = slot_mask(slots, args.slots, dtype)
            dense = lora_dense(x, a, bt, mask)
            assert torch.allclose(dense.float(), lora_gather(x, a, bt, slots).float(),
                                  rtol=2e-2, atol=2e-1 * width)
            with torch.inference_mode():
                ms = {
                    "base": per_call_ms(lambda: F.linear(x, weight), args.repeat),
                    "dense": per_call_ms(lambda: lora_dense(x, a, bt, mask), args.repeat),
                    "gather": per_call_ms(lambda: lora_gather(x, a, bt, slots), args.repeat),
                    "grouped": per_call_ms(lambda: lora_grouped(x, a, bt, slots), args.repeat),
                }
            for key, value in ms.items():
                totals[key] += value if rows == 16 else 0.0
            print(f"{name:8} {rows:5d} " + " ".join(f"{ms[k]:8.3f}" for k in ms))
    print("decode (16 rows), one layer's four sites: " + ", ".join(
        f"{k} {v:.3f} ms" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
