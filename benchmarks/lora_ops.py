"""The batched LoRA op, three ways, against the base linear it rides on (CPU).

    python benchmarks/lora_ops.py [--slots 4] [--active 4] [--rank 16] [--dtype bfloat16]
        [--threads N]

For each projection site of a SmolLM2-135M-sized layer (qkv, o, gate_up, down) and a decode
(16 rows) and a prefill (256 rows) batch whose rows are spread over ``--active`` of the
``--slots`` adapters, prints the median microseconds per call (each call timed on its own:
a loaded host's stalls land in few calls) of: the base linear alone; ``dense`` (every
slot's shrink as one GEMM, a one-hot mask, one expand GEMM per part: static shapes, the
model's op); ``gather`` (each row's A and B gathered, batched matmuls: static shapes);
``grouped`` (rows grouped by slot, a shrink and expands per adapter present: data-dependent
shapes, eager only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.models.lora.ops import (  # noqa: E402
    lora_dense,
    lora_gather,
    lora_grouped,
    slot_groups,
    slot_mask,
)

# (name, inputs, part widths) of SmolLM2-135M: hidden 576, 9 heads + 3 KV heads of 64
SITES = [("qkv", 576, (576, 192, 192)), ("o", 576, (576,)), ("gate_up", 576, (1536, 1536)),
         ("down", 1536, (576,))]


def per_call_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--active", type=int, default=None, help="adapters in the batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 is steadier on a loaded host)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    active = args.slots if args.active is None else args.active
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, {args.slots} slots, {active} in the batch, "
          f"rank {args.rank}, {args.dtype}; median us per call")
    print(f"{'site':8} {'rows':>5} {'base':>8} {'dense':>8} {'gather':>8} {'grouped':>8}")
    totals = {"base": 0.0, "dense": 0.0, "gather": 0.0, "grouped": 0.0}
    for rows in (16, 256):
        for name, inputs, parts in SITES:
            outputs = sum(parts)
            weight = torch.randn(outputs, inputs, dtype=dtype)
            a = torch.randn(len(parts), args.slots, args.rank, inputs, dtype=dtype)
            bt = torch.randn(args.slots, args.rank, outputs, dtype=dtype)
            x = torch.randn(rows, inputs, dtype=dtype)
            slots = torch.arange(rows) % (active + 1)  # the active slots and some base rows
            mask = slot_mask(slots, args.slots, dtype)
            groups = slot_groups(slots.tolist())
            dense = lora_dense(x, a, bt, mask, parts)
            for other in (lora_gather(x, a, bt, slots, parts),
                          lora_grouped(x, a, bt, groups, parts)):
                torch.testing.assert_close(dense.float(), other.float(), rtol=2e-2,
                                           atol=5e-2 * args.rank * len(parts))
            with torch.inference_mode():
                us = {
                    "base": per_call_us(lambda: F.linear(x, weight), args.repeat),
                    "dense": per_call_us(lambda: lora_dense(x, a, bt, mask, parts),
                                         args.repeat),
                    "gather": per_call_us(lambda: lora_gather(x, a, bt, slots, parts),
                                          args.repeat),
                    "grouped": per_call_us(lambda: lora_grouped(x, a, bt, groups, parts),
                                           args.repeat),
                }
            for key, value in us.items():
                totals[key] += value if rows == 16 else 0.0
            print(f"{name:8} {rows:5d} " + " ".join(f"{us[k]:8.1f}" for k in us))
    print("decode (16 rows), one layer's four sites: " + ", ".join(
        f"{k} {v:.0f} us" for k, v in totals.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
