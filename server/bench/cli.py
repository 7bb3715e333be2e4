"""``hpu-serve bench`` arguments and entry point (the shape of ``vllm bench serve``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path

from server.bench.client import Endpoint
from server.bench.report import format_summary
from server.bench.runner import discover_model, run_workload
from server.bench.workload import WorkloadSpec, synthetic_requests
from server.cache_dir import writable_cache_dir
from server.config import BenchOptions
from server.config.fields import build


def load_tokenizer(path: str | None, cache_dir: str | None = None):  # -> Tokenizer
    from server.engine.tokenizer import Tokenizer
    from server.models.loader import resolve_model_source

    source = resolve_model_source(path)
    return Tokenizer.from_model_path(source.folder, source.gguf_file,
                                     cache_dir=writable_cache_dir(cache_dir) / "tokenizers")


def run_bench(args: argparse.Namespace) -> int:
    opts = build(BenchOptions, args)  # the one knob: HPU_SERVE_CACHE_DIR
    tokenizer = load_tokenizer(opts.tokenizer, opts.cache_dir)
    spec = WorkloadSpec(opts.num_prompts, opts.input_len, opts.output_len, opts.range_ratio,
                        opts.seed, shared_prefix_len=opts.shared_prefix_len,
                        long_fraction=opts.long_prompt_fraction,
                        long_input_len=opts.long_input_len, turns=opts.turns)
    if opts.turns > 1 and opts.endpoint != "chat":
        raise SystemExit("error: --turns needs --endpoint chat")
    special = set(tokenizer.hf.all_special_ids)
    requests = synthetic_requests(spec, tokenizer, special)
    model = opts.model or asyncio.run(discover_model(opts.base_url, opts.api_key))
    endpoint = Endpoint(opts.base_url, model, opts.endpoint, opts.api_key, opts.ignore_eos)
    if opts.warmup_requests:
        asyncio.run(run_workload(endpoint, requests[: opts.warmup_requests], progress=False))
    summary, results = asyncio.run(run_workload(
        endpoint, requests, opts.request_rate, opts.max_concurrency, opts.seed,
        opts.burstiness, opts.progress,
    ))
    print(format_summary(summary))
    if opts.result_file:
        record = {
            "label": opts.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "base_url": opts.base_url, "model": model, "endpoint": opts.endpoint,
            "workload": dataclasses.asdict(spec),
            "request_rate": opts.request_rate, "max_concurrency": opts.max_concurrency,
            **summary.to_dict(),
            "per_request": {
                "prompt_len": [r.prompt_len for r in results],
                "output_tokens": [r.output_tokens for r in results],
                "ttft_s": [r.ttft for r in results], "e2e_s": [r.latency for r in results],
                "ok": [r.ok for r in results],
            },
        }
        Path(opts.result_file).write_text(json.dumps(record, indent=2, default=str))
    return 0 if summary.failed == 0 else 1
