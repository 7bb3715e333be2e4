"""The FastAPI application factory: routes, middleware, lifespan. No module globals."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import server
from server.api.admission import ClientSeqs
from server.api.anthropic import add_anthropic_routes
from server.api.chat_output import chat_parsers
from server.api.errors import APIError, install_error_handlers
from server.api.load import install_load_tracking
from server.api.lora_routes import add_lora_routes
from server.api.middleware import GuardMiddleware
from server.api.openapi import install_openapi
from server.api.pooling.routes import add_pooling_routes
from server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvocationRequest,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
)
from server.api.request_body import body_schema, parse_body
from server.api.request_checks import check_messages
from server.api.request_log import LoggedEngine, RequestLog
from server.api.responses import add_responses_routes
from server.api.routing import respond, tag_of, until_disconnect
from server.api.serving import (
    EngineClient,
    ServingContext,
)
from server.api.serving_chat import create_chat_completion
from server.api.serving_completion import create_completion
from server.api.sleep_routes import add_sleep_routes
from server.api.tokenize_routes import add_tokenize_routes
from server.api.tracing import RequestTracer
from server.api.workers import PreprocessPool
from server.config import FairShare, ServerConfig
from server.engine.lora.request import LoRARequest
from server.metrics import ServerMetrics

# How often the event loop checks how late it wakes (hpu_serve:event_loop_lag_seconds).
LAG_PROBE_INTERVAL_S = 0.1


def build_app(engine: EngineClient, cfg: ServerConfig,
              tracer: RequestTracer | None = None) -> FastAPI:
    """The app serving ``engine``; the engine starts and stops with the app's lifespan.
    ``tracer``: where request spans go (default: as ``cfg.tracing`` says)."""
    request_log = RequestLog(cfg.logging) if cfg.logging.enable_log_requests else None
    if request_log is not None:  # the handlers' submissions fill in each request's line
        engine = LoggedEngine(engine, request_log)
    metrics = ServerMetrics(engine.model_name, engine.stats, alive=lambda: engine.is_alive)
    # The device layer's registry is itself a collector: folded into one /metrics.
    metrics.registry.register(engine.metrics_registry)
    tool_parser, reasoning_parser = chat_parsers(cfg.chat)
    ctx = ServingContext(engine, engine.model_name, engine.max_model_len, metrics,
                         cfg.max_waiting_requests, cfg.limits, cfg.chat, tool_parser,
                         reasoning_parser, PreprocessPool(cfg.preprocess_workers),
                         ClientSeqs(cfg.max_client_seqs, cfg.fair_share is not FairShare.OFF,
                                    metrics.registry),
                         tracer or RequestTracer.from_config(cfg.tracing, engine.model_name),
                         cfg.enable_prompt_tokens_details, engine.sampling_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # the oversized-prompt bound decodes the vocabulary once: here, not in a request
        await ctx.workers.run("startup", lambda: engine.tokenizer.max_token_bytes)
        probe = asyncio.ensure_future(_probe_lag(metrics))
        try:
            yield
        finally:
            probe.cancel()
            await engine.shutdown()
            ctx.workers.shutdown()

    app = FastAPI(title="hpu-serve", version=server.__version__, lifespan=lifespan,
                  root_path=cfg.root_path)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    _add_routes(app, ctx)
    add_sleep_routes(app, engine)
    add_tokenize_routes(app, ctx, cfg.enable_tokenizer_info_endpoint)
    add_responses_routes(app, ctx, cfg.responses)
    add_lora_routes(app, engine)
    install_openapi(app)
    install_load_tracking(app, cfg.enable_server_load_tracking)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(cfg.allowed_origins),
        allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
        allow_credentials=cfg.allow_credentials,
    )
    app.add_middleware(GuardMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       fair_share=cfg.fair_share,
                       max_request_id_length=cfg.max_request_id_length,
                       request_log=request_log)
    add_anthropic_routes(app, ctx)  # after the guards: its error shape covers their answers
    app.state.health_stall_timeout = cfg.health_stall_timeout
    return app


async def _probe_lag(metrics: ServerMetrics) -> None:
    """How late the loop wakes from a short sleep: the time every ready callback (a request
    being parsed, a response being written) waited behind whatever held the loop."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(LAG_PROBE_INTERVAL_S)
        metrics.observe_loop_lag(max(0.0, loop.time() - start - LAG_PROBE_INTERVAL_S))


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    def few_messages(data: Any) -> None:  # before validating 300,000 of them
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            check_messages(ctx.limits, len(data["messages"]))

    add_pooling_routes(app, ctx)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, ChatCompletionRequest, ctx.workers, tag.client,
                                few_messages)
        work = create_chat_completion(ctx, body, tag)
        return respond(await until_disconnect(request, work))

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, CompletionRequest, ctx.workers, tag.client)
        work = create_completion(ctx, body, tag)
        return respond(await until_disconnect(request, work))

    @app.post("/invocations", openapi_extra=body_schema(InvocationRequest))
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point, as vLLM serves it: chat when the body has messages,
        else a completion."""
        tag = tag_of(request)
        body = (await parse_body(request, InvocationRequest, ctx.workers, tag.client,
                                 few_messages)).root
        work = (create_chat_completion(ctx, body, tag)
                if isinstance(body, ChatCompletionRequest) else create_completion(ctx, body, tag))
        return respond(await until_disconnect(request, work))

    def card() -> ModelCard:
        return ModelCard(id=ctx.model_name, root=ctx.model_name,
                         max_model_len=ctx.max_model_len)

    def adapter_card(lora: LoRARequest) -> ModelCard:  # vLLM's: parent is the base model
        return ModelCard(id=lora.lora_name, root=lora.lora_path,
                         parent=lora.base_model_name or ctx.model_name)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()] + [adapter_card(a) for a in ctx.engine.lora_adapters()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        """One model, as OpenAI's retrieve answers (an id may hold slashes: org/name)."""
        if model_id == ctx.model_name:
            return card()
        lora = ctx.engine.lora_adapter(model_id)
        if lora is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model",
                           "model_not_found")
        return adapter_card(lora)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        """Drops every cached prompt prefix (vLLM's endpoint; behind --api-key)."""
        return ResetPrefixCacheResponse(dropped_blocks=await ctx.engine.reset_prefix_cache())

    @app.get("/buckets/observed")
    async def buckets_observed() -> JSONResponse:
        """Unpadded step shapes seen so far and per-bucket warmup seconds, the input of
        ``hpu-serve buckets --suggest`` (behind --api-key)."""
        return JSONResponse(ctx.engine.observed_shapes())

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check (vLLM's)
    async def health() -> Response:
        if not ctx.engine.is_alive:
            raise APIError(503, "the engine loop is not running")
        stalled = ctx.engine.stalled_for()
        if stalled > app.state.health_stall_timeout:
            raise APIError(503, f"the engine has had work but finished no step for "
                                f"{stalled:.0f} s (--health-stall-timeout "
                                f"{app.state.health_stall_timeout:g})", code="engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
