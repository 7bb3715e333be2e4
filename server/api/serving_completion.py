"""POST /v1/completions: one engine request per prompt (each tokenized and checked in one job
on a worker), choices indexed prompt * n + i."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from server.api.answer_json import LogprobFormatter, answer_bytes
from server.api.beam_search import beam_params, submit_beam_search
from server.api.errors import APIError
from server.api.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from server.api.request_checks import check_limits, prompt_logprobs_of, reject_unsupported
from server.api.serving import (
    RequestTag,
    ServingContext,
    answered_model,
    build_sampling_params,
    cached_tokens,
    check_model,
    created_now,
    json_answer,
    merge,
    refuse_generation,
    refuse_oversized,
    request_tap,
    sse,
    sse_chunk,
    submit,
    system_fingerprint,
    tapped,
    usage,
)
from server.engine.inputs import PromptBuilder, PromptInput
from server.engine.outputs import CompletionOutput, RequestOutput
from server.engine.sampling_params import SamplingParams

# vLLM's words (its clients match them); prompt_embeds is refused when given, see
# request_checks.py
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


def _prompts(prompt: str | list[str] | list[int] | list[list[int]] | None
             ) -> list[str | list[int]]:
    if prompt is None:
        raise APIError(400, EMPTY_PROMPT, "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, EMPTY_PROMPT, "prompt")
    return list(prompt)  # type: ignore[arg-type]


def _builder(ctx: ServingContext, prompt: str | list[int], field: str,
             params: SamplingParams) -> PromptBuilder:
    """The engine gets token ids and only checks them; text is tokenized in the same job on
    a worker, unless it provably holds more tokens than the context allows."""
    def build() -> PromptInput:
        if isinstance(prompt, str):
            refuse_oversized(ctx, len(prompt.encode("utf-8")), field,
                             truncating=params.truncate_prompt_tokens is not None)
            return PromptInput(ctx.engine.tokenizer.encode(prompt), params)
        return PromptInput(prompt, params)

    return build


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, tag: RequestTag
) -> Response | AsyncIterator[str]:
    refuse_generation(ctx)
    lora = check_model(ctx, req.model)
    reject_unsupported(req, chat=False)
    if req.suffix:
        raise APIError(400, "suffix is not supported", "suffix", "unsupported_parameter")
    echo_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt "
                            "back, nothing generated)", "max_tokens")
    prompts = _prompts(req.prompt)
    # 16 is the field's default (vLLM's, OpenAI's) when neither the request nor the model's
    # generation config (max_new_tokens) says otherwise; the request's own value wins
    sent = "max_tokens" in req.model_fields_set or ctx.sampling_defaults.max_tokens is None
    requested_max = req.max_tokens if sent else None
    check_limits(ctx.limits, req, max_model_len=ctx.max_model_len, prompts=len(prompts),
                 max_tokens=ctx.sampling_defaults.max_tokens_for(requested_max),
                 max_tokens_field="max_tokens",
                 logprobs=req.logprobs, logprobs_field="logprobs")
    vocab = ctx.engine.tokenizer.vocab_size
    # echo with logprobs: the echoed prompt's tokens carry theirs (vLLM's, OpenAI's)
    prompt_logprobs = prompt_logprobs_of(ctx.limits, req, vocab,
                                         implied=req.logprobs if req.echo else None)
    # echo with max_tokens 0 generates one token that is never shown, as vLLM does
    params = build_sampling_params(req, 1 if echo_only else requested_max, req.logprobs,
                                   vocab, prompt_logprobs, defaults=ctx.sampling_defaults)
    beams = beam_params(req, params.max_tokens or ctx.max_model_len, req.logprobs)
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            build = _builder(ctx, prompt, field, params)
            stream = (await submit_beam_search(ctx, tag, build, beams, index=i, lora=lora,
                                               logprobs=req.logprobs) if beams is not None
                      else await submit(ctx, tag, build, params.n, index=i, lora=lora))
            index = i if len(prompts) > 1 else None
            streams.append(tapped(stream, request_tap(ctx, params, tag, index)))
    except BaseException:
        for i in range(len(streams)):
            ctx.engine.abort(tag.engine_id(i))
        raise
    response_id = f"cmpl-{tag.request_id}"
    if req.stream:
        return _stream(ctx, streams, response_id, req, prompts, answered_model(ctx, lora))
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge(streams):
        if i in finals:
            finals[i].add(out)
        else:
            finals[i] = out

    def build() -> bytes:  # on a worker: many prompts x n x logprobs add up
        choices = []
        logprobs: list[dict[str, Any] | None] = []
        formatter = ctx.logprob_format(req)
        for i in range(len(prompts)):
            out = finals[i]
            prefix = _echo_text(ctx, prompts[i], out) if req.echo else ""
            scored = (None if out.prompt_logprobs is None
                      else formatter.prompt_logprobs(out.prompt_logprobs))
            for c in out.outputs:
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=prefix + ("" if echo_only else c.text),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids
                    else None,
                    token_ids=list(c.token_ids) if req.return_token_ids else None,
                    prompt_logprobs=scored,
                ))
                logprobs.append(_logprobs(formatter, req, out, c, 0, echo=req.echo,
                                          echo_only=echo_only))
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals.values())
        generated = sum(o.num_generated_tokens for o in finals.values())
        skeleton = CompletionResponse(
            id=response_id, created=created_now(), model=answered_model(ctx, lora),
            choices=choices,
            usage=usage(prompt_tokens, generated, cached_tokens(ctx, *finals.values())),
            system_fingerprint=system_fingerprint(ctx.model_name))
        return answer_bytes(skeleton, logprobs)

    return await json_answer(ctx, tag, build)


async def _stream(ctx: ServingContext, streams: list[AsyncIterator[RequestOutput]],
                  response_id: str, req: CompletionRequest, prompts: list[str | list[int]],
                  model: str) -> AsyncIterator[str]:
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    created = created_now()
    echo_only = req.echo and req.max_tokens == 0
    choice_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    ended: set[int] = set()
    prompt_tokens: dict[int, int] = {}
    generated: dict[int, int] = {}
    lasts: dict[int, RequestOutput] = {}  # each prompt's latest output (its metrics)

    def chunk(choices: list[CompletionChoice],
              logprobs: list[dict[str, Any] | None] | None = None, **extra: object) -> str:
        body = CompletionResponse(id=response_id, created=created, model=model,
                                  choices=choices,
                                  system_fingerprint=system_fingerprint(ctx.model_name),
                                  **extra)
        return sse_chunk(body, logprobs)

    async for i, out in merge(streams):
        prompt_tokens[i] = len(out.prompt_token_ids)
        generated[i] = out.num_generated_tokens
        lasts[i] = out
        choices = []
        logprobs: list[dict[str, Any] | None] = []
        for c in out.outputs:
            index = i * req.n + c.index
            if index in ended:
                continue  # it stays finished in later outputs of an n > 1 request
            text = "" if echo_only else c.text
            echo_now = req.echo and index not in echoed
            if echo_now:
                echoed.add(index)
                text = _echo_text(ctx, prompts[i], out) + text
            if not (text or c.finish_reason or c.logprobs):
                continue  # nothing to send yet (text held back in case of a stop string)
            if c.finish_reason:
                ended.add(index)
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(text)
            first_chunk = index not in choice_tokens
            choice_tokens[index] = choice_tokens.get(index, 0) + len(c.token_ids)
            choices.append(CompletionChoice(
                index=index, text=text,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_token_ids=list(out.prompt_token_ids)
                if req.return_token_ids and first_chunk else None,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            ))
            logprobs.append(_logprobs(ctx.logprob_format(req), req, out, c, offset,
                                      echo=echo_now, echo_only=echo_only))
        # one choice per chunk, as vLLM streams n > 1 (clients index chunk.choices[0])
        for choice, choice_logprobs in zip(choices, logprobs):
            # continuous usage: the prompt's tokens and this choice's tokens so far, as vLLM
            extra = {"usage": usage(prompt_tokens[i], choice_tokens[choice.index])} \
                if continuous else {}
            yield chunk([choice], [choice_logprobs], **extra)
    if include_usage:
        yield chunk([], usage=usage(sum(prompt_tokens.values()), sum(generated.values()),
                                    cached_tokens(ctx, *lasts.values())))
    yield sse("[DONE]")


def _logprobs(formatter: LogprobFormatter, req: CompletionRequest, out: RequestOutput,
              c: CompletionOutput, offset: int, echo: bool, echo_only: bool
              ) -> dict[str, Any] | None:
    """A choice's ``logprobs`` (None when not asked): with ``echo`` the prompt's tokens
    first (the first has no logprob), then the completion's unless only echoed."""
    if req.logprobs is None:
        return None
    completion = [] if echo_only else (c.logprobs or [])
    if not echo:
        return formatter.completion_dict(completion, offset) if completion else None
    prompt = out.prompt_logprobs or []
    return formatter.completion_dict([*prompt, *completion], offset,
                                     [*out.prompt_token_ids, *c.token_ids])


def _echo_text(ctx: ServingContext, prompt: str | list[int], out: RequestOutput) -> str:
    """The prompt as sent when it was text (the engine got token ids), else its decoding
    with its special tokens written out, as vLLM echoes a token-id prompt (``<s>`` stays)."""
    return prompt if isinstance(prompt, str) else ctx.engine.tokenizer.decode(
        out.prompt_token_ids, skip_special_tokens=False)
