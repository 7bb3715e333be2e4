"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and, with
``--enable-tokenizer-info-endpoint``, ``GET /tokenizer_info`` (404 without it, as in vLLM).

Tokenizing and rendering run on the preprocess pool: their cost grows with the input."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from server.api.answer_json import dumps
from server.api.errors import APIError
from server.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from server.api.request_body import body_schema, parse_body
from server.api.request_checks import check_messages
from server.api.routing import JSONBytes, tag_of
from server.api.serving import ServingContext, check_model, content_bytes, refuse_oversized
from server.api.serving_chat import checked_template_kwargs
from server.api.tools import template_messages


def add_tokenize_routes(app: FastAPI, ctx: ServingContext, tokenizer_info: bool) -> None:
    """The routes on ``app``; ``tokenizer_info``: whether ``GET /tokenizer_info`` exists."""

    def few_messages(data: Any) -> None:  # before validating 300,000 of them
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            check_messages(ctx.limits, len(data["messages"]))

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest),
              response_model=TokenizeResponse)
    async def tokenize(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, TokenizeRequest, ctx.workers, tag.client,
                                few_messages)
        check_model(ctx, body.model)
        _refuse_unsupported(body)
        kwargs = checked_template_kwargs(body.chat_template_kwargs)
        tok = ctx.engine.tokenizer

        def count() -> bytes:  # on a worker: a 15 MB prompt took 8 s on the loop
            if body.messages is not None:
                refuse_oversized(ctx, content_bytes(body.messages), "messages", leave=0)
                messages = template_messages([m.model_dump(exclude_none=True)
                                              for m in body.messages])
                tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
                text = tok.apply_chat_template(messages, body.add_generation_prompt, tools,
                                               kwargs, body.continue_final_message)
                tokens = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
            elif body.prompt is not None:
                refuse_oversized(ctx, len(body.prompt.encode("utf-8")), "prompt", leave=0)
                special = body.add_special_tokens is not False
                tokens = tok.encode(body.prompt, add_special_tokens=special)
            else:
                raise APIError(400, "either prompt or messages is required", "prompt")
            strs = tok.convert_ids_to_tokens(tokens) if body.return_token_strs else None
            return dumps({"count": len(tokens), "max_model_len": ctx.max_model_len,
                          "tokens": tokens, "token_strs": strs}).encode("utf-8")

        try:
            return JSONBytes(await ctx.workers.run(tag.client, count))
        except ValueError as exc:  # the template refused them, as in chat completions
            raise APIError(400, str(exc), "messages") from None

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest),
              response_model=DetokenizeResponse)
    async def detokenize(request: Request) -> Response:
        tag = tag_of(request)
        body = await parse_body(request, DetokenizeRequest, ctx.workers, tag.client)
        check_model(ctx, body.model)
        tok = ctx.engine.tokenizer

        def text() -> bytes:
            vocab = tok.vocab_size
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
            return dumps({"prompt": tok.decode(body.tokens)}).encode("utf-8")

        return JSONBytes(await ctx.workers.run(tag.client, text))

    if tokenizer_info:
        @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
        async def tokenizer_info_route() -> Response:
            """The tokenizer's settings, class and chat template (vLLM's shape)."""
            return JSONBytes(dumps(ctx.engine.tokenizer.settings()).encode("utf-8"))


def _refuse_unsupported(body: TokenizeRequest) -> None:
    """400 for the fields vLLM's /tokenize takes that would change the tokens here."""
    extra = body.model_extra or {}
    if extra.get("chat_template") is not None:  # a request's template runs on the server
        raise APIError(400, "chat_template is not supported by this server (refused rather "
                            "than ignored: it would change the tokens)", "chat_template",
                       "unsupported_parameter")
    if body.messages is not None and body.continue_final_message \
            and body.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                            "true: a continued message gets no new turn",
                       "continue_final_message")
