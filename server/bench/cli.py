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


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="any OpenAI-compatible server")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="HF folder or .gguf whose tokenizer sizes the prompts "
                        "(default: the embedded SmolLM2 model)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=200, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="tokens of a prefix common to every prompt (a shared system "
                             "prompt), before each prompt's own --input-len tokens")
    parser.add_argument("--long-prompt-fraction", type=float, default=0.0,
                        help="this fraction of the prompts is --long-input-len tokens long")
    parser.add_argument("--long-input-len", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=1,
                        help="each prompt opens a chat of this many user turns (--input-len "
                             "new tokens each), every turn resending the history with the "
                             "server's answers (needs --endpoint chat)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of arrival gaps; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let generation stop at EOS (default: always output-len tokens)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--warmup-requests", type=int, default=1,
                        help="untimed requests sent first")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    parser.add_argument("--label", default="", help="stored in the result file")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def load_tokenizer(path: str | None):  # -> server.engine.tokenizer.Tokenizer
    from server.engine.tokenizer import Tokenizer
    from server.models.loader import resolve_model_source

    source = resolve_model_source(path)
    return Tokenizer.from_model_path(source.folder, source.gguf_file)


def run_bench(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    spec = WorkloadSpec(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                        args.seed, shared_prefix_len=args.shared_prefix_len,
                        long_fraction=args.long_prompt_fraction,
                        long_input_len=args.long_input_len, turns=args.turns)
    if args.turns > 1 and args.endpoint != "chat":
        raise SystemExit("error: --turns needs --endpoint chat")
    special = set(tokenizer.hf.all_special_ids)
    requests = synthetic_requests(spec, tokenizer, special)
    model = args.model or asyncio.run(discover_model(args.base_url, args.api_key))
    endpoint = Endpoint(args.base_url, model, args.endpoint, args.api_key, args.ignore_eos)
    if args.warmup_requests:
        asyncio.run(run_workload(endpoint, requests[: args.warmup_requests], progress=False))
    summary, results = asyncio.run(run_workload(
        endpoint, requests, args.request_rate, args.max_concurrency, args.seed,
        args.burstiness, args.progress,
    ))
    print(format_summary(summary))
    if args.result_file:
        record = {
            "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
            "workload": dataclasses.asdict(spec),
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            **summary.to_dict(),
            "per_request": {
                "prompt_len": [r.prompt_len for r in results],
                "output_tokens": [r.output_tokens for r in results],
                "ttft_s": [r.ttft for r in results], "e2e_s": [r.latency for r in results],
                "ok": [r.ok for r in results],
            },
        }
        Path(args.result_file).write_text(json.dumps(record, indent=2, default=str))
    return 0 if summary.failed == 0 else 1
