"""Bucket plans fitted to traffic vs the static ones: padded tokens, buckets, warmup.

    python benchmarks/bucket_fit.py [--requests 600] [--save-dir DIR]
    python benchmarks/bucket_fit.py --observed observed-chat.json ...

Traffic: three workloads shaped like ``hpu-serve bench`` runs (the bench's length rule:
uniform in [len * (1 - r), len * (1 + r)], its long-prompt mix, its gamma arrival gaps with
``--burstiness``): chat, a long-prompt mix, and a bursty one. Their step shapes come from the
engine's own scheduler and block manager run without a model (chunked prefill under a
2,048-token step budget, prefix caching, prefills with context alone, prompt batches only
where the default plan has a bucket), recorded by the server's own ``ShapeStats``. Limits:
block 128, max-model-len 4096, 64 sequences, 2,048 KV blocks.

Warmup cost per bucket is SYNTHETIC (no Gaudi here): a Gaudi-like line, a few seconds of
graph compilation per bucket plus a term growing with its size, "measured" for every bucket
of the default plan as a server's warmup would; other buckets are estimated by the fitter's
line through those points. Replace it with a real ``/buckets/observed`` dump to redo the
comparison on hardware.

Plans compared, each replayed with the runtime's bucket choice: the default exponential
plan, the linear plan, and ``--suggest`` with the default plan's warmup as its budget. The
suggestion is also replayed on a second trace of the same workload (another seed), to show
how it holds on traffic it was not fitted to. ``--observed DUMP...`` compares the same plans
on real servers' dumps instead (with their measured warmup).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from server.bench.workload import arrival_gaps  # noqa: E402
from server.config import (
    BucketingConfig,  # noqa: E402
    SchedulerLimits,  # noqa: E402
)
from server.engine.core.block_manager import BlockManager  # noqa: E402
from server.engine.core.scheduler import Scheduler  # noqa: E402
from server.engine.core.sequence import Sequence  # noqa: E402
from server.engine.sampling_params import SamplingParams  # noqa: E402
from server.hpu.buckets.fit import KV_WEIGHT, Observed, WarmupModel, evaluate, suggest  # noqa: E402
from server.hpu.buckets.lookup import ShapePlanner, exact_bucket  # noqa: E402
from server.hpu.buckets.observed import ShapeStats  # noqa: E402
from server.hpu.buckets.plan import decode_buckets, prefill_buckets, resolve_ranges  # noqa: E402
from server.hpu.buckets.suggest import reference_plan  # noqa: E402
from server.hpu.counters import DeviceCounters  # noqa: E402
from server.hpu.types import BucketLimits, Phase  # noqa: E402

# the server's defaults on an accelerator: chunked prefill with a 2,048-token step budget
BLOCK, MAX_LEN, MAX_SEQS, BUDGET, NUM_BLOCKS = 128, 4096, 64, 2048, 2048
LIMITS = BucketLimits(MAX_LEN, MAX_SEQS, BUDGET, NUM_BLOCKS)
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
    """Step shapes of ``n`` requests of ``workload`` through the engine's own scheduler and
    block manager, as a Gaudi server with the default plan runs them: chunked prefill under
    the step budget, prefix caching, a prefill with context alone in its step, prompt
    batches admitted only where the default plan has a bucket (padding-aware admission).
    No model: each step "samples" a random token and advances a clock by a cost model."""
    in_len, out_len, ratio, long_frac, long_len, rate, burst = WORKLOADS[workload]
    rng = random.Random(seed)
    long = set(random.Random(seed + 2).sample(range(n), round(n * long_frac)))
    t, arrivals = 0.0, []
    for i, gap in enumerate(arrival_gaps(rate, n, seed, burst)):
        t += gap
        p = min(lengths(rng, long_len if i in long else in_len, ratio), MAX_LEN - out_len)
        arrivals.append((t, p, lengths(rng, out_len, ratio)))
    ranges = resolve_ranges(BucketingConfig(), block_size=BLOCK, max_model_len=MAX_LEN,
                            max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET,
                            num_blocks=NUM_BLOCKS, with_context=True)
    planner = ShapePlanner(prefill_buckets(ranges), decode_buckets(ranges),
                           DeviceCounters("bench", CollectorRegistry()))
    limits = SchedulerLimits(MAX_SEQS, BUDGET, MAX_LEN, chunked_prefill=True,
                             context_prefill_alone=True)
    blocks = BlockManager(NUM_BLOCKS, BLOCK, enable_caching=True)
    scheduler = Scheduler(limits, blocks,
                          lambda bs, q: planner.prefill_fits(bs, q, BUDGET))
    stats = ShapeStats("bench", CollectorRegistry())
    wanted: dict[int, int] = {}  # seq id -> output tokens to generate
    now, i = 0.0, 0
    while i < len(arrivals) or scheduler.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, prompt, out = arrivals[i]
            ids = [rng.randrange(3, 50000) for _ in range(prompt)]
            seq = Sequence(i, f"r{i}", 0, ids, SamplingParams(max_tokens=out), arrivals[i][0])
            wanted[i] = out
            scheduler.add(seq)
            i += 1
        batches = scheduler.schedule()
        if not batches:
            now = arrivals[i][0]
            continue
        for batch in batches:
            seqs = batch.seqs
            new = [batch.new_tokens(row) for row in range(len(seqs))]
            if batch.phase is Phase.PREFILL:  # what ModelRunner._bucket records
                ctx = max(-(-s.num_computed_tokens // BLOCK) for s in seqs)
                shape = exact_bucket(Phase.PREFILL, len(seqs), max(new), ctx)
                now += 0.004 + len(seqs) * max(new) * 2e-5  # overhead + ~50k tokens/s
            else:
                shape = exact_bucket(Phase.DECODE, len(seqs),
                                     sum(len(s.block_table) for s in seqs))
                now += 0.012 + len(seqs) * 1e-4
            stats.record(batch.phase, shape, sum(new))
            rows = batch.sampling_rows
            scheduler.advance(batch)
            for seq in seqs:
                blocks.cache_blocks(seq, seq.num_computed_tokens)
            for row in rows:
                seq = seqs[row]
                seq.output_token_ids.append(rng.randrange(3, 50000))
                if seq.num_output_tokens >= wanted[seq.seq_id]:
                    scheduler.finish(seq)
    stats.describe(block_size=BLOCK, limits=LIMITS, plan=planner.buckets)
    return stats


def synthetic_warmup(stats: ShapeStats, plan: dict[Phase, list]) -> None:
    """Gaudi-like warmup seconds for each bucket of ``plan`` (see the module docstring)."""
    for b in plan[Phase.PREFILL]:
        stats.warmed(Phase.PREFILL, b, 4.0 + b[0] * b[1] * 6e-4)
    for b in plan[Phase.DECODE]:
        stats.warmed(Phase.DECODE, b, 2.0 + b[0] * 0.01 + b[2] * 2e-3)


def table_rows(name: str, obs: Observed, kv_weight: float,
               held_out: Observed | None = None) -> list[str]:
    """The default exp, linear and suggested plans (budget: the default plan's warmup) on
    ``obs``, and the default and suggested ones on ``held_out`` if given."""
    warmup = WarmupModel(obs.warmup)
    default = reference_plan(obs, "exp")
    base = evaluate(obs, default, warmup)
    plans = {"default exp": default, "linear": reference_plan(obs, "lin"),
             "suggested": suggest(obs, warmup_budget=base.warmup_seconds, warmup=warmup,
                                  kv_weight=kv_weight)}
    out = []
    for plan_name, plan in plans.items():
        rows = [(plan_name, evaluate(obs, plan, warmup), base)]
        if held_out is not None and plan_name != "linear":
            rows.append((plan_name + " (held-out trace)", evaluate(held_out, plan, warmup),
                         evaluate(held_out, default, warmup)))
        for label, c, ref in rows:
            change = 100.0 * (c.total_padded_tokens / max(ref.total_padded_tokens, 1) - 1)
            out.append(f"| {name} | {label} | {c.total_buckets} | {c.warmup_seconds:.0f} | "
                       f"{c.total_padded_tokens:,} | {change:+.1f}% | "
                       f"{sum(c.padded_kv_blocks.values()):,} | {sum(c.misses.values())} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--save-dir", type=Path, default=None,
                    help="write each workload's observed JSON here (for buckets --suggest)")
    ap.add_argument("--kv-weight", type=float, default=KV_WEIGHT)
    ap.add_argument("--observed", type=Path, nargs="*", default=[],
                    help="saved GET /buckets/observed dumps of real servers: compared with "
                    "their own measured warmup instead of the simulated workloads")
    args = ap.parse_args()
    print("| workload | plan | buckets | warmup s | padded tokens | vs default | "
          "padded KV blocks | misses |")
    print("|" + "---|" * 8)
    for path in args.observed:
        obs = Observed.from_json(json.loads(path.read_text()))
        for row in table_rows(path.stem, obs, args.kv_weight):
            print(row)
    if args.observed:
        return
    for name in WORKLOADS:
        stats = simulate(name, args.requests, seed=1)
        synthetic_warmup(stats, reference_plan(Observed.from_json(stats.snapshot()), "exp"))
        doc = stats.snapshot()
        if args.save_dir:
            args.save_dir.mkdir(parents=True, exist_ok=True)
            (args.save_dir / f"{name.replace(' ', '_')}.json").write_text(json.dumps(doc))
        held_out = Observed.from_json(simulate(name, args.requests, seed=2).snapshot())
        for row in table_rows(name, Observed.from_json(doc), args.kv_weight, held_out):
            print(row)


if __name__ == "__main__":
    main()
