"""``hpu-serve buckets --suggest``: fetch the observed shapes, fit a plan, compare, write it.

The fitting itself is :mod:`server.hpu.buckets.fit` (pure); this module does the I/O: reading
``GET /buckets/observed`` or a saved dump, the reference plans to compare with, the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from server.config import BucketingConfig, api_key_from_env
from server.hpu.buckets.fit import (
    KV_WEIGHT,
    QUERY_STEP,
    Observed,
    PlanCost,
    WarmupModel,
    evaluate,
    format_bucket_file,
    suggest,
)
from server.hpu.buckets.plan import decode_buckets, prefill_buckets, resolve_ranges
from server.hpu.types import Bucket, Phase


def load_observed(source: str, api_key: str | None = None) -> dict[str, Any]:
    """The JSON document from a server's base URL (or the endpoint's full URL) or a file."""
    if source.startswith(("http://", "https://")):
        import httpx

        url = source.rstrip("/")
        if not url.endswith("/buckets/observed"):
            url += "/buckets/observed"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = httpx.get(url, headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()
    return json.loads(Path(source).read_text())


def reference_plan(obs: Observed, strategy: str = "exp") -> dict[Phase, list[Bucket]]:
    """The plan the static ``strategy`` (exp: the default, or lin) gives the observed
    server's limits, with a context dimension if any observed prefill had context or the
    server's own plan has one (prefix caching or chunked prefill on)."""
    lim = obs.limits
    if (lim is None or lim.max_model_len is None or lim.max_num_seqs is None
            or lim.max_num_batched_tokens is None):
        raise ValueError("the observed document has no engine limits to plan for")
    ranges = resolve_ranges(
        BucketingConfig(strategy=strategy), block_size=obs.block_size,
        max_model_len=lim.max_model_len, max_num_seqs=lim.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens,
        with_context=any(s.blocks > 0 for s in obs.shapes[Phase.PREFILL]) or any(
            b.blocks > 0 for b in (obs.plan or {}).get(Phase.PREFILL, ())))
    return {Phase.PREFILL: prefill_buckets(ranges), Phase.DECODE: decode_buckets(ranges)}


def comparison(rows: dict[str, PlanCost]) -> str:
    """A table: buckets, padded tokens per phase, padded KV blocks, misses, warmup."""
    head = (f"{'plan':<12} {'buckets':>7} {'padded prompt':>14} {'padded decode':>14} "
            f"{'padded total':>13} {'pad KV blocks':>14} {'misses':>7} {'warmup s':>9}")
    out = [head, "-" * len(head)]
    for name, c in rows.items():
        out.append(f"{name:<12} {c.total_buckets:>7} {c.padded_tokens[Phase.PREFILL]:>14,} "
                   f"{c.padded_tokens[Phase.DECODE]:>14,} {c.total_padded_tokens:>13,} "
                   f"{sum(c.padded_kv_blocks.values()):>14,} {sum(c.misses.values()):>7} "
                   f"{c.warmup_seconds:>9.1f}")
    return "\n".join(out)


def suggest_buckets(args: argparse.Namespace) -> int:
    """Entry point of ``hpu-serve buckets --suggest``; returns the exit status."""
    if not args.source:
        raise SystemExit("error: --suggest needs --from URL_OR_JSON")
    try:
        obs = Observed.from_json(load_observed(args.source,
                                               api_key_from_env(args.api_key)))
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: cannot read observed shapes from {args.source}: {exc}")
    if not obs.static_shapes:
        print("warning: these shapes were recorded by an eager server. Eager steps pack "
              "prompts together, decodes included and prefills after a cached prefix too, "
              "where a graph server runs each prefill with context alone and admits only "
              "batches its plan holds, so the fit below is for traffic the plan will not "
              "see. Record on the server that will run the plan (--execution-mode graphs "
              "or compile).", file=sys.stderr)
    warmup = WarmupModel(obs.warmup)
    current_name = "current"
    current = obs.plan
    if current is None:  # the server ran without bucketing: compare with the default
        current, current_name = reference_plan(obs), "default exp"
    base = evaluate(obs, current, warmup)
    max_buckets, budget = args.max_buckets, args.warmup_budget
    if max_buckets is None and budget is None:
        # the same warmup as today (or, unmeasured, the same number of buckets)
        if warmup.measured_any:
            budget = base.warmup_seconds
        else:
            max_buckets = base.total_buckets
    kv_weight = KV_WEIGHT if args.kv_weight is None else args.kv_weight
    try:
        plan = suggest(obs, max_buckets=max_buckets, warmup_budget=budget,
                       kv_weight=kv_weight, warmup=warmup,
                       cover_limits=not args.observed_only,
                       query_step=args.query_step or QUERY_STEP)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    fitted = evaluate(obs, plan, warmup)
    steps = sum(sum(s.values()) for s in obs.shapes.values())
    limit = (f"max {max_buckets} buckets" if max_buckets is not None
             else f"warmup <= {budget:.1f} s")
    header = (f"hpu-serve buckets --suggest: fitted to {steps} observed steps ({limit})\n"
              f"use with VLLM_BUCKETING_FROM_FILE={args.output}")
    text = format_bucket_file(plan, header)
    Path(args.output).write_text(text)
    print(text, end="")
    print()
    print(comparison({current_name: base, "suggested": fitted}))
    saved = base.total_padded_tokens - fitted.total_padded_tokens
    share = 100.0 * abs(saved) / base.total_padded_tokens if base.total_padded_tokens else 0.0
    trend = "fewer" if saved >= 0 else "more"
    missed = sum(base.misses.values())
    misses = (f"; the {current_name} plan missed {missed} steps (run unpadded, so "
              "not counted above)" if missed else "")
    print(f"\nexpected padded tokens: {fitted.total_padded_tokens:,} vs "
          f"{base.total_padded_tokens:,} ({share:.1f}% {trend}{misses}); expected warmup "
          f"{fitted.warmup_seconds:.1f} s vs {base.warmup_seconds:.1f} s"
          + ("" if warmup.measured_any else " (no measured warmup: 1 s per bucket)"))
    print(f"wrote {args.output}")
    return 0
