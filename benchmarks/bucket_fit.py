"""Bucket plans fitted to traffic vs the static ones: padded tokens, buckets, warmup.

    python benchmarks/bucket_fit.py [--requests 600] [--save-dir DIR]

Traffic: three workloads shaped like ``hpu-serve bench`` runs (the bench's length rule:
uniform in [len * (1 - r), len * (1 + r)], its long-prompt mix, its gamma arrival gaps with
``--burstiness``): chat, a long-prompt mix, and a bursty one. Their step shapes come from a
small continuous-batching simulation (no model: one prefill per step first, as the default
plan's prompt batch size of 1 allows, otherwise one decode step over every running
sequence; KV blocks per sequence grow with its tokens), recorded by the server's own
``ShapeStats``. Limits: the ``hpu-serve buckets`` defaults (block 128, max-model-len 4096)
with 64 sequences.

Warmup cost per bucket is SYNTHETIC (no Gaudi here): a Gaudi-like line, a few seconds of
graph compilation per bucket plus a term growing with its size, "measured" for every bucket
of the default plan as a server's warmup would; other buckets are estimated by the fitter's
line through those points. Replace it with a real ``/buckets/observed`` dump to redo the
comparison on hardware.

Plans compared, each replayed with the runtime's bucket choice: the default exponential
plan, the linear plan, and ``--suggest`` with the default plan's warmup as its budget. The
suggestion is also replayed on a second trace of the same workload (another seed), to show
how it holds on traffic it was not fitted to.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from server.bench.workload import arrival_gaps  # noqa: E402
from server.bucket_suggest import reference_plan  # noqa: E402
from server.hpu.bucket_fit import KV_WEIGHT, Observed, WarmupModel, evaluate, suggest  # noqa: E402
from server.hpu.shape_stats import ShapeStats  # noqa: E402
from server.hpu.types import Phase  # noqa: E402

BLOCK, MAX_LEN, MAX_SEQS, BUDGET = 128, 4096, 64, 4096
LIMITS = {"max_model_len": MAX_LEN, "max_num_seqs": MAX_SEQS, "max_num_batched_tokens": BUDGET}
# name: (input_len, output_len, range_ratio, long_fraction, long_input_len, rate/s, burstiness)
WORKLOADS = {
    "chat": (512, 256, 0.9, 0.0, 0, 6.0, 1.0),
    "long-prompt mix": (256, 128, 0.5, 0.2, 3000, 6.0, 1.0),
    "bursty": (384, 192, 0.8, 0.05, 2048, 8.0, 0.1),
}


def lengths(rng: random.Random, mean: int, ratio: float) -> int:
    """The bench's rule (``server.bench.workload._length``)."""
    return rng.randint(max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio))))


def simulate(workload: str, n: int, seed: int) -> ShapeStats:
    """Step shapes of ``n`` requests of ``workload`` through a continuous-batching loop."""
    in_len, out_len, ratio, long_frac, long_len, rate, burst = WORKLOADS[workload]
    rng = random.Random(seed)
    long = set(random.Random(seed + 2).sample(range(n), round(n * long_frac)))
    t, arrivals = 0.0, []
    for i, gap in enumerate(arrival_gaps(rate, n, seed, burst)):
        t += gap
        p = min(lengths(rng, long_len if i in long else in_len, ratio), MAX_LEN - out_len)
        arrivals.append((t, p, lengths(rng, out_len, ratio)))
    stats = ShapeStats("bench", CollectorRegistry())
    waiting: deque[tuple[int, int]] = deque()
    running: list[list[int]] = []  # [tokens so far, tokens still to generate]
    now, i = 0.0, 0
    while i < len(arrivals) or waiting or running:
        while i < len(arrivals) and arrivals[i][0] <= now:
            waiting.append(arrivals[i][1:])
            i += 1
        if waiting and len(running) < MAX_SEQS:
            prompt, out = waiting.popleft()
            stats.record(Phase.PROMPT, (1, prompt, 0), prompt)
            running.append([prompt + 1, out - 1])
            now += 0.004 + prompt * 2e-5  # a prefill: overhead + ~50k tokens/s
        elif running:
            blocks = sum(-(-tok // BLOCK) for tok, _ in running)
            stats.record(Phase.DECODE, (len(running), 1, blocks), len(running))
            for seq in running:
                seq[0] += 1
                seq[1] -= 1
            running = [s for s in running if s[1] > 0]
            now += 0.012 + len(running) * 1e-4
        else:
            now = arrivals[i][0]
    stats.describe(block_size=BLOCK, limits=LIMITS, plan=None)
    return stats


def synthetic_warmup(stats: ShapeStats, plan: dict[Phase, list]) -> None:
    """Gaudi-like warmup seconds for each bucket of ``plan`` (see the module docstring)."""
    for b in plan[Phase.PROMPT]:
        stats.warmed(Phase.PROMPT, b, 4.0 + b[0] * b[1] * 6e-4)
    for b in plan[Phase.DECODE]:
        stats.warmed(Phase.DECODE, b, 2.0 + b[0] * 0.01 + b[2] * 2e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--save-dir", type=Path, default=None,
                    help="write each workload's observed JSON here (for buckets --suggest)")
    ap.add_argument("--kv-weight", type=float, default=KV_WEIGHT)
    args = ap.parse_args()
    head = (f"| workload | plan | buckets | warmup s (est.) | padded tokens | vs default | "
            f"padded KV blocks | misses |")
    print(head)
    print("|" + "---|" * 8)
    for name in WORKLOADS:
        stats = simulate(name, args.requests, seed=1)
        obs0 = Observed.from_json(stats.snapshot())
        default = reference_plan(obs0, "exp")
        synthetic_warmup(stats, default)
        doc = stats.snapshot()
        if args.save_dir:
            args.save_dir.mkdir(parents=True, exist_ok=True)
            (args.save_dir / f"{name.replace(' ', '_')}.json").write_text(json.dumps(doc))
        obs = Observed.from_json(doc)
        warmup = WarmupModel(obs.warmup)
        base = evaluate(obs, default, warmup)
        plans = {"default exp": default, "linear": reference_plan(obs, "lin"),
                 "suggested": suggest(obs, warmup_budget=base.warmup_seconds, warmup=warmup,
                                          kv_weight=args.kv_weight)}
        held_out = Observed.from_json(simulate(name, args.requests, seed=2).snapshot())
        for plan_name, plan in plans.items():
            rows = [(plan_name, evaluate(obs, plan, warmup))]
            if plan_name != "linear":
                rows.append((plan_name + " (held-out trace)", evaluate(held_out, plan, warmup)))
            for label, c in rows:
                ref = base if "held-out" not in label else evaluate(held_out, default, warmup)
                change = 100.0 * (c.total_padded_tokens / max(ref.total_padded_tokens, 1) - 1)
                print(f"| {name} | {label} | {c.total_buckets} | {c.warmup_seconds:.0f} | "
                      f"{c.total_padded_tokens:,} | {change:+.1f}% | "
                      f"{sum(c.padded_kv_blocks.values()):,} | {sum(c.misses.values())} |")


if __name__ == "__main__":
    main()
