"""``hpu-serve`` command line: ``serve`` loads the engine, warms it up, then opens the port."""

from __future__ import annotations

import argparse
import logging
import sys

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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "-h", "--help"):
        argv = ["serve", *argv]  # `python -m server MODEL ...` means serve
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    build_parser().print_help()
    return 2


def serve(args: argparse.Namespace) -> int:
    from server.api.app import AppSettings, build_app
    from server.api.http_server import run_http_server
    from server.engine.async_engine import AsyncEngine

    init_logging()
    engine_cfg = engine_config_from_args(args)
    server_cfg = server_config_from_args(args)
    engine = AsyncEngine.from_config(engine_cfg)  # load + KV cache sizing
    warmup = getattr(engine.engine, "warmup", None)
    if warmup is not None:
        warmup()  # every bucket compiled/captured before the port opens
    core = engine.engine
    app = build_app(engine, AppSettings(
        model_name=core.model_name, max_model_len=core.limits.max_model_len,
        api_key=server_cfg.api_key, max_body_bytes=server_cfg.max_body_bytes,
        max_waiting_requests=server_cfg.max_waiting_requests,
        allowed_origins=server_cfg.allowed_origins, allowed_methods=server_cfg.allowed_methods,
        allowed_headers=server_cfg.allowed_headers,
        allow_credentials=server_cfg.allow_credentials,
    ))
    logger.info("serving %s on http://%s:%d", core.model_name, server_cfg.host, server_cfg.port)
    run_http_server(app, server_cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
