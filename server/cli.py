"""``hpu-serve`` command line: ``serve`` loads the engine, warms it up, then opens the port."""

from __future__ import annotations

import argparse
import logging
import sys

from server.bench.cli import add_bench_args
from server.config import (
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)
from server.log import init_logging

logger = logging.getLogger("server.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpu-serve", description="OpenAI-compatible LLM server (vLLM-style flags)."
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)
    buckets = sub.add_parser("buckets", help="print the bucket plan of a configuration "
                             "(no model is loaded)",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    buckets.add_argument("--max-model-len", type=int, default=4096)
    buckets.add_argument("--max-num-seqs", type=int, default=256)
    buckets.add_argument("--max-num-batched-tokens", type=int, default=None)
    buckets.add_argument("--block-size", type=int, default=128)
    buckets.add_argument("--num-gpu-blocks-override", type=int, default=None,
                         help="KV blocks of the cache, for the decode block clamp")
    sub.add_parser("platforms", help="list discovered platforms and the one selected")
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server with a "
                           "synthetic streaming workload",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_args(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "buckets", "platforms", "bench", "-h", "--help"):
        argv = ["serve", *argv]  # `python -m server MODEL ...` means serve
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "buckets":
        return print_buckets(args)
    if args.command == "platforms":
        return print_platforms()
    if args.command == "bench":
        from server.bench.cli import run_bench

        return run_bench(args)
    build_parser().print_help()
    return 2


def print_buckets(args: argparse.Namespace, environ: dict[str, str] | None = None) -> int:
    """The warmup plan for these limits and the VLLM_* bucketing environment."""
    from server.config import bucketing_environment
    from server.hpu.bucketing import bucketing_config, format_plan

    batched = args.max_num_batched_tokens or max(args.max_model_len, 2048)
    cfg = bucketing_config(
        dict(bucketing_environment(environ)), block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, num_blocks=args.num_gpu_blocks_override,
    )
    print(format_plan(cfg))
    return 0


def print_platforms() -> int:
    from server.hpu.platform import detect_platform, discover_platforms

    for name, platform in sorted(discover_platforms().items()):
        state = f"available ({platform.device})" if platform is not None else "not available"
        print(f"{name:<8} {state}")
    print(f"selected: {detect_platform('auto').name}")
    return 0


def serve(args: argparse.Namespace) -> int:
    """Loads and warms up the engine, then serves; returns the process's exit status:
    0 after a SIGTERM drain, 1 when the engine died (the orchestrator restarts the pod)."""
    from server.api.app import AppSettings, build_app
    from server.api.http_server import HttpServer
    from server.engine.async_engine import AsyncEngine

    init_logging()
    engine_cfg = engine_config_from_args(args)
    server_cfg = server_config_from_args(args)
    engine = AsyncEngine.from_config(engine_cfg)  # load + KV cache sizing
    # every bucket compiled/captured before the port opens, on the thread that will serve
    engine.call(engine.engine.warmup)
    core = engine.engine
    app = build_app(engine, AppSettings(
        model_name=core.model_name, max_model_len=core.limits.max_model_len,
        api_key=server_cfg.api_key, max_body_bytes=server_cfg.max_body_bytes,
        max_waiting_requests=server_cfg.max_waiting_requests,
        allowed_origins=server_cfg.allowed_origins, allowed_methods=server_cfg.allowed_methods,
        allowed_headers=server_cfg.allowed_headers,
        allow_credentials=server_cfg.allow_credentials, limits=server_cfg.limits,
    ))
    http = HttpServer(app, server_cfg)

    def engine_died(exc: BaseException) -> None:
        logger.critical("the engine died (%r): stopping the server, exit status 1", exc)
        http.stop()

    engine.on_dead = engine_died
    logger.info("serving %s on http://%s:%d", core.model_name, server_cfg.host, server_cfg.port)
    http.run()
    return 1 if engine.dead_reason is not None else 0

if __name__ == "__main__":
    sys.exit(main())
