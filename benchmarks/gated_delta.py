"""The gated delta rule (Qwen3-Next's linear attention) on a prompt: chunked (what prefill
runs) against token by token (what decode runs), one linear layer's worth at Qwen3-Next-80B's
per-rank head sizes, float32 on this machine's CPU.

    python benchmarks/gated_delta.py                 # 512 tokens, 32 value heads
    python benchmarks/gated_delta.py --tokens 2048 --heads 16

Prints the median time of each over ``--repeats`` runs (the two interleaved, so that a
shared machine's load falls on both alike), their ratio, and the largest difference between
their outputs (they compute the same recurrence).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from server.models.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule


def timed(fns: list, repeats: int) -> list[tuple[float, tuple[torch.Tensor, ...]]]:  # noqa: ANN001
    times: list[list[float]] = [[] for _ in fns]
    outs: list = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - start)
    return [(statistics.median(t), out) for t, out in zip(times, outs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32, help="value heads (key heads: half)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    t, hv, d = args.tokens, args.heads, args.head_dim
    q = torch.randn(1, t, hv // 2, d, generator=gen)
    k = torch.randn(1, t, hv // 2, d, generator=gen)
    v = torch.randn(1, t, hv, d, generator=gen)
    g = -torch.rand(1, t, hv, generator=gen)
    beta = torch.rand(1, t, hv, generator=gen)
    state = torch.zeros(1, hv, d, d)
    with torch.inference_mode():
        (chunked, (out_c, state_c)), (stepped, (out_r, state_r)) = timed(
            [lambda: chunked_gated_delta_rule(q, k, v, g, beta, state),
             lambda: recurrent_gated_delta_rule(q, k, v, g, beta, state)], args.repeats)
    print(f"{t} tokens, {hv} value heads of {d} x {d}, {torch.get_num_threads()} threads")
    print(f"chunked (64-token chunks): {chunked * 1e3:9.1f} ms")
    print(f"token by token:            {stepped * 1e3:9.1f} ms   ({stepped / chunked:.1f}x)")
    print(f"max |difference|: output {(out_c - out_r).abs().max().item():.2e}, "
          f"state {(state_c - state_r).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
