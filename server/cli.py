"""``hpu-serve`` command line: ``serve`` loads the engine, warms it up, then opens the port."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import threading

from server.config import (
    BatchOptions,
    BenchOptions,
    BucketFitOptions,
    BucketingConfig,
    CacheConfig,
    EngineConfig,
    ModelOptions,
    MultiModalConfig,
    PoolingConfig,
    Runner,
    SchedulerConfig,
    SchedulerLimits,
    ServerConfig,
    SpecMethod,
    SpeculativeConfig,
    engine_config_from_args,
    server_config_from_args,
)
from server.config.compat import ignored_flags
from server.config.fields import add_flags, build, env_help
from server.log import init_logging

logger = logging.getLogger("server.cli")

# `buckets` loads no model to read its context length from
PLAN_MAX_MODEL_LEN = 4096
# serve's flags that shape a bucket plan
PLAN_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
              "num_blocks_override", "enable_chunked_prefill", "enable_prefix_caching")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default shown; the epilog's list of environment variables kept as laid out."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpu-serve", description="OpenAI-compatible LLM server (vLLM-style flags)."
    )
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           formatter_class=HelpFormatter,
                           epilog=env_help(EngineConfig, ServerConfig))
    add_flags(serve, EngineConfig, ServerConfig)
    buckets = sub.add_parser("buckets", help="print the bucket plan of a configuration "
                             "(no model is loaded)", formatter_class=HelpFormatter,
                             epilog=env_help(BucketingConfig))
    add_flags(buckets, SchedulerConfig, CacheConfig, only=PLAN_FLAGS,
              defaults={"max_model_len": PLAN_MAX_MODEL_LEN})
    add_flags(buckets, BucketFitOptions)
    add_flags(buckets, SpeculativeConfig)
    # a vision model's encoder buckets: its folder's config.json (no weights) and the limit
    add_flags(buckets, ModelOptions, only=("model",))
    add_flags(buckets, MultiModalConfig, only=("limit_mm_per_prompt", "mm_processor_kwargs"))
    # a pooling model's plan is (batch, length) shapes of whole inputs, not prompt buckets
    add_flags(buckets, PoolingConfig, only=("runner", "convert", "task"))
    batch = sub.add_parser("run-batch", help="answer an OpenAI batch file offline (vLLM's "
                           "run-batch): one answer line per request", formatter_class=HelpFormatter,
                           epilog=env_help(EngineConfig, ServerConfig))
    add_flags(batch, EngineConfig, ServerConfig, BatchOptions)
    sub.add_parser("platforms", help="list discovered platforms and the one selected")
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server with a "
                           "synthetic streaming workload", formatter_class=HelpFormatter,
                           epilog=env_help(BenchOptions))
    add_flags(bench, BenchOptions)  # its client (httpx, rich) is imported when it runs
    return parser


def vllm_spelling(argv: list[str]) -> list[str]:
    """``argv`` with each option's underscores read as dashes (``--max_model_len 5000``,
    ``--max_num_seqs=8``), as vLLM's parser takes them; values are left as they are."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "run-batch", "buckets", "platforms", "bench", "-h",
                                   "--help"):
        argv = ["serve", *argv]  # `python -m server MODEL ...` means serve
    args = build_parser().parse_args(vllm_spelling(argv))
    if args.command == "serve":
        return serve(args)
    if args.command == "run-batch":
        return run_batch(args)
    if args.command == "buckets":
        if args.suggest:
            from server.hpu.buckets.suggest import suggest_buckets

            return suggest_buckets(args)
        return print_buckets(args)
    if args.command == "platforms":
        return print_platforms()
    if args.command == "bench":
        from server.bench.cli import run_bench

        return run_bench(args)
    build_parser().print_help()
    return 2


def print_buckets(args: argparse.Namespace, environ: dict[str, str] | None = None) -> int:
    """The warmup plan for these limits and the VLLM_* bucketing environment (with
    ``--runner pooling``: the pooling runner's (batch, length) plan)."""
    from server.config import bucketing_config_from_env
    from server.hpu.buckets.plan import format_plan, resolve_ranges, verify_buckets

    try:
        pooling = PoolingConfig(args.runner, args.convert, args.task)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if pooling.runner is Runner.POOLING:
        return print_pooling_buckets(args)

    # the step's token budget, resolved as the engine resolves it (without a platform: its
    # default with chunked prefill is the generic one)
    batched = SchedulerLimits.resolve(
        SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=args.enable_chunked_prefill),
        args.max_model_len).max_num_batched_tokens
    ranges = resolve_ranges(
        bucketing_config_from_env(environ), block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, num_blocks=args.num_gpu_blocks_override,
        with_context=args.enable_chunked_prefill or args.enable_prefix_caching,
    )
    spec = build(SpeculativeConfig, args, environ).settings
    verify = (verify_buckets(ranges, spec.query_len, spec.disable_by_batch_size)
              if spec is not None else None)
    print(format_plan(ranges, verify))
    encoder = encoder_plan(args, batched)
    if encoder:
        print(encoder)
    if spec is not None and spec.method is SpecMethod.DRAFT_MODEL:
        print(f"Draft model {spec.model}: warms every bucket above on its own graphs (it "
              "mirrors each target step); its draft steps are the decode buckets")
    elif spec is not None and spec.method.reads_hidden_states:
        name = spec.model or "(the target's MTP layer)"
        print(f"{spec.method} head {name}: warms every bucket above on its own graphs "
              "(it mirrors each target step on the target's hidden states); its draft "
              "steps are the decode buckets")
    return 0


def encoder_plan(args: argparse.Namespace, max_num_batched_tokens: int) -> str | None:
    """A vision model's encoder buckets, from its config.json alone (None: no model given,
    or a text-only one)."""
    model = args.model_flag or args.model
    if not model:
        return None
    from server.engine.multimodal.plan import encoder_plan as plan_of
    from server.models.loader import load_vision_config, resolve_model_source
    from server.models.vision import with_processor_kwargs

    try:
        cfg = load_vision_config(resolve_model_source(model))
        mm = MultiModalConfig(limit_mm_per_prompt=args.limit_mm_per_prompt,
                              mm_processor_kwargs=args.mm_processor_kwargs)
        if cfg is None:
            return None
        cfg = with_processor_kwargs(cfg, mm.processor_kwargs)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    return plan_of(cfg, mm.image_limit, args.max_num_seqs, max_num_batched_tokens).description


def print_pooling_buckets(args: argparse.Namespace) -> int:
    """The buckets a pooling model warms, with the limits resolved as its engine resolves
    them (no chunked prefill: an input runs whole)."""
    from server.hpu.buckets.pooling import format_pooling_plan, pooling_buckets

    try:
        limits = SchedulerLimits.resolve(
            SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens),
            args.max_model_len, chunked_prefill=False)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_pooling_plan(pooling_buckets(limits.max_model_len, limits.max_num_seqs,
                                              limits.max_num_batched_tokens)))
    return 0


def print_platforms() -> int:
    from server.hpu.platform import detect_platform, discover_platforms

    for name, platform in sorted(discover_platforms().items()):
        state = f"available ({platform.device})" if platform is not None else "not available"
        print(f"{name:<8} {state}")
    print(f"selected: {detect_platform('auto').name}")
    return 0


def checked_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """serve's configs from the flags and the environment; a bad flag or variable: one line
    naming it, before anything loads. Logging starts in --log-format."""
    from server.api.chat_output import chat_parsers
    from server.api.http_server import check_tls

    try:
        engine_cfg = engine_config_from_args(args)
        server_cfg = server_config_from_args(args)
        chat_parsers(server_cfg.chat)  # an unknown parser name fails before the model loads
        check_tls(server_cfg)  # a key that does not load, too
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    # before anything loads: every line of the run in --log-format, workers' included
    init_logging(server_cfg.logging.log_format)
    for line in ignored_flags(engine_cfg.vllm_no_op):
        logger.warning("%s", line)
    return engine_cfg, server_cfg


def serve(args: argparse.Namespace) -> int:
    """Loads and warms up the engine, then serves; returns the process's exit status:
    0 after a SIGTERM drain, 1 when the engine died (the orchestrator restarts the pod)."""
    from server.api.app import build_app
    from server.api.http_server import HttpServer
    from server.engine.async_engine import AsyncEngine
    from server.models.errors import ModelFileError

    engine_cfg, server_cfg = checked_configs(args)
    engine_dead = threading.Event()

    def engine_died(exc: BaseException) -> None:  # on the engine's thread
        logger.critical("the engine died (%r): stopping the server, exit status 1", exc)
        engine_dead.set()

    try:
        engine = AsyncEngine.from_config(  # load + KV sizing
            engine_cfg, on_dead=engine_died, stats_interval=server_cfg.logging.stats_interval)
    except ModelFileError as exc:  # a damaged or mismatched model: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
    # every bucket compiled/captured before the port opens, on the thread that will serve
    engine.call(engine.engine.warmup)
    app = build_app(engine, server_cfg)
    # a death before anyone listened (a TP worker, say) has set it already: exits at once
    http = HttpServer(app, server_cfg, on_deadline=engine.abort_all, stop_when=engine_dead)
    logger.info("serving %s on %s://%s:%d", engine.model_name,
                "https" if server_cfg.tls else "http", server_cfg.host, server_cfg.port)
    http.run()
    # The interpreter's exit collects garbage twice; the first pass, with every module still
    # alive, is skipped: 0.25 s of a tiny server's 1.25 s stop. The second, after the modules
    # are cleared, still runs: it frees nanobind's objects (triton, xgrammar), whose leak
    # check prints to stderr otherwise (gc.freeze skipped both, and broke JSON logs so).
    gc.disable()
    return 1 if engine.dead_reason is not None else 0


def run_batch(args: argparse.Namespace) -> int:
    """vLLM's ``run-batch``: loads the engine as serve does, answers every request of the
    batch file through the server's routes (no port), writes the answer lines; 0 when every
    line has its answer (refusals included), 1 when the engine died on the way."""
    import asyncio

    from server.api.app import build_app
    from server.api.batch import read_batch
    from server.api.batch import run_batch as answer_batch
    from server.api.batch.metrics import serve_metrics
    from server.engine.async_engine import AsyncEngine
    from server.models.errors import ModelFileError

    opts = build(BatchOptions, args, environ={})
    try:
        opts.validate()
        with (sys.stdin if opts.input_file == "-" else open(opts.input_file)) as f:
            requests = read_batch(f.read())  # a malformed file fails before the model loads
    except (ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    engine_cfg, server_cfg = checked_configs(args)
    late = serve_metrics(server_cfg.host, server_cfg.port) if opts.enable_metrics else None
    try:
        engine = AsyncEngine.from_config(engine_cfg)
    except ModelFileError as exc:
        raise SystemExit(f"error: {exc}") from None
    engine.call(engine.engine.warmup)
    app = build_app(engine, server_cfg)
    if late is not None:
        late.registry = app.state.metrics.registry
    logger.info("run-batch: %d requests from %s", len(requests), opts.input_file)
    outputs = asyncio.run(answer_batch(app, requests, api_key=server_cfg.api_key,
                                       concurrency=2 * engine_cfg.scheduler.max_num_seqs))
    lines = "".join(out.model_dump_json() + "\n" for out in outputs)
    if opts.output_file == "-":
        sys.stdout.write(lines)
    else:
        with open(opts.output_file, "w") as f:
            f.write(lines)
    failed = sum(out.error is not None for out in outputs)
    logger.info("run-batch: %d answers written to %s (%d with an error)", len(outputs),
                opts.output_file, failed)
    return 1 if engine.dead_reason is not None else 0

if __name__ == "__main__":
    sys.exit(main())
