"""The FastAPI application factory: routes, middleware, lifespan. No module globals."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import server
from server.api.admission import ClientSeqs
from server.api.chat_output import chat_parsers
from server.api.errors import APIError, install_error_handlers
from server.api.middleware import GuardMiddleware
from server.api.openapi import install_openapi
from server.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.api.serving import (
    EngineClient,
    RequestTag,
    ServingContext,
    check_model,
    guarded_sse,
)
from server.api.serving_chat import create_chat_completion
from server.api.serving_completion import create_completion
from server.api.tools import template_messages
from server.config import FairShare, ServerConfig
from server.metrics import ServerMetrics


def build_app(engine: EngineClient, cfg: ServerConfig) -> FastAPI:
    """The app serving ``engine``; the engine starts and stops with the app's lifespan."""
    metrics = ServerMetrics(engine.model_name, engine.stats, alive=lambda: engine.is_alive)
    # The device layer's registry is itself a collector: folded into one /metrics.
    metrics.registry.register(engine.metrics_registry)
    tool_parser, reasoning_parser = chat_parsers(cfg.chat)
    ctx = ServingContext(engine, engine.model_name, engine.max_model_len, metrics,
                         cfg.max_waiting_requests, cfg.limits, cfg.chat, tool_parser,
                         reasoning_parser, ClientSeqs(cfg.max_client_seqs, cfg.fair_share
                                                     is not FairShare.OFF, metrics.registry))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="hpu-serve", version=server.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    _add_routes(app, ctx)
    install_openapi(app)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(cfg.allowed_origins),
        allow_methods=list(cfg.allowed_methods), allow_headers=list(cfg.allowed_headers),
        allow_credentials=cfg.allow_credentials,
    )
    app.add_middleware(GuardMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       fair_share=cfg.fair_share,
                       max_request_id_length=cfg.max_request_id_length)
    return app


def _tag(request: Request) -> RequestTag:
    state = request.scope.get("state", {})
    return RequestTag(str(state.get("request_id")), str(state.get("client", "addr:unknown")))


async def _until_disconnect(request: Request, work: Awaitable[object]) -> object:
    """Runs a handler but cancels it if the client goes away first: the cancelled iteration
    aborts the engine request, so an abandoned non-streaming request stops using KV blocks."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def _respond(result: object) -> Response:
    if isinstance(result, Response):
        return result
    if hasattr(result, "__aiter__"):
        return StreamingResponse(guarded_sse(result),  # type: ignore[arg-type]
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump())  # type: ignore[attr-defined]


def _add_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        work = create_chat_completion(ctx, body, _tag(request))
        return _respond(await _until_disconnect(request, work))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        work = create_completion(ctx, body, _tag(request))
        return _respond(await _until_disconnect(request, work))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, root=ctx.model_name,
                                         max_model_len=ctx.max_model_len)])

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
    async def health() -> Response:
        if not ctx.engine.is_alive:
            raise APIError(503, "the engine loop is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(ctx, body.model)
        tok = ctx.engine.tokenizer
        if body.messages is not None:
            messages = template_messages([m.model_dump(exclude_none=True)
                                          for m in body.messages])
            try:
                tokens = tok.encode_chat(messages, body.add_generation_prompt)
            except ValueError as exc:  # the template refused them, as in chat completions
                raise APIError(400, str(exc), "messages") from None
        elif body.prompt is not None:
            tokens = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "either prompt or messages is required", "prompt")
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(ctx, body.model)
        vocab = ctx.engine.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=ctx.engine.tokenizer.decode(body.tokens))
