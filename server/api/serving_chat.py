"""POST /v1/chat/completions: chat template -> engine -> response or SSE chunks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from server.api.errors import APIError
from server.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
)
from server.api.request_checks import check_limits, check_messages, reject_unsupported
from server.api.serving import (
    MetricsTap,
    ServingContext,
    accumulate,
    build_sampling_params,
    check_model,
    created_now,
    json_logprob,
    sse,
    sse_chunk,
    submit,
    system_fingerprint,
    tapped,
    usage,
)
from server.engine.outputs import RequestOutput, TokenLogprob


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, request_id: str
) -> ChatCompletionResponse | AsyncIterator[str]:
    check_model(ctx, req.model)
    reject_unsupported(req, chat=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens
    check_messages(ctx.limits, len(req.messages))
    check_limits(ctx.limits, req, max_model_len=ctx.max_model_len, prompts=1,
                 max_tokens=max_tokens, logprobs=logprobs, logprobs_field="top_logprobs",
                 max_tokens_field="max_completion_tokens" if req.max_completion_tokens
                 else "max_tokens")
    params = build_sampling_params(req, max_tokens, logprobs, ctx.engine.tokenizer.vocab_size)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        prompt_ids = await asyncio.to_thread(
            ctx.engine.tokenizer.encode_chat, messages, req.add_generation_prompt
        )
    except ValueError as exc:  # no template, unsupported content parts
        raise APIError(400, str(exc), "messages") from None
    stream = tapped(await submit(ctx, request_id, prompt_ids, params), MetricsTap(ctx.metrics, params))
    response_id = f"chatcmpl-{request_id}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(ctx, stream, response_id, req.n, include_usage)
    final = await accumulate(stream)
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=_logprobs(ctx, c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        for c in final.outputs
    ]
    return ChatCompletionResponse(
        id=response_id, created=created_now(), model=ctx.model_name, choices=choices,
        usage=usage(len(final.prompt_token_ids), final.num_generated_tokens),
        system_fingerprint=system_fingerprint(ctx.model_name),
    )


async def _stream(ctx: ServingContext, stream: AsyncIterator[RequestOutput], response_id: str,
                  n: int, include_usage: bool) -> AsyncIterator[str]:
    created = created_now()

    def chunk(choices: list[ChatStreamChoice], **extra: object) -> str:
        body = ChatCompletionChunk(id=response_id, created=created, model=ctx.model_name,
                                   choices=choices,
                                   system_fingerprint=system_fingerprint(ctx.model_name),
                                   **extra)
        return sse_chunk(body)

    for i in range(n):
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    final: RequestOutput | None = None
    ended: set[int] = set()
    async for out in stream:
        final = out
        choices = []
        for c in out.outputs:
            if c.index in ended:
                continue  # it stays finished in later outputs of an n > 1 request
            if not (c.text or c.finish_reason or c.logprobs):
                continue  # nothing to send yet (text held back in case of a stop string)
            if c.finish_reason:
                ended.add(c.index)
            choices.append(ChatStreamChoice(
                index=c.index,
                delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                logprobs=_logprobs(ctx, c.logprobs) if c.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            ))
        if choices:
            yield chunk(choices)
    if include_usage and final is not None:
        yield chunk([], usage=usage(len(final.prompt_token_ids), final.num_generated_tokens))
    yield sse("[DONE]")


def _logprobs(ctx: ServingContext, entries: list[TokenLogprob]) -> ChatLogprobs:
    tok = ctx.engine.tokenizer
    content = []
    for e in entries:
        text = tok.token_str(e.token_id)
        content.append(ChatLogprob(
            token=text, logprob=json_logprob(e.logprob), bytes=list(text.encode("utf-8")),
            top_logprobs=[
                TopLogprob(token=(s := tok.token_str(t)), logprob=json_logprob(lp),
                           bytes=list(s.encode()))
                for t, lp in e.top
            ],
        ))
    return ChatLogprobs(content=content)
