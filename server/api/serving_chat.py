"""POST /v1/chat/completions: chat template (with tools) -> engine -> response or SSE chunks
(reasoning and tool calls read back by server/api/chat_output.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from server.api.answer_json import answer_bytes
from server.api.beam_search import beam_params, submit_beam_search
from server.api.chat_output import ChoiceReader, DeltaParts
from server.api.errors import APIError
from server.api.media.chat import (
    ImageRef,
    check_images,
    image_refs,
    load_images,
    with_image_parts,
)
from server.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    TextPart,
    ToolCallOut,
)
from server.api.reasoning_parsers import ReasoningParser
from server.api.request_checks import (
    check_limits,
    check_messages,
    prompt_logprobs_of,
    reject_unsupported,
)
from server.api.serving import (
    RequestTag,
    ServingContext,
    accumulate,
    answered_model,
    build_sampling_params,
    cached_tokens,
    check_model,
    content_bytes,
    created_now,
    json_answer,
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
from server.api.tools import ToolPlan, plan_tools, template_messages
from server.engine.inputs import PromptInput
from server.engine.outputs import RequestOutput
from server.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request on its way through the engine: its outputs, and how to read them back
    as OpenAI's message parts (reasoning, content, tool calls). The Responses API
    (server/api/responses/) and Anthropic's Messages API (server/api/anthropic/) serve
    their requests through the same run."""

    stream: AsyncIterator[RequestOutput]
    plan: ToolPlan
    reasoning: type[ReasoningParser] | None
    model: str  # what the answer's model field says (an adapter's name, or the base's)

    def reader(self) -> ChoiceReader:
        return ChoiceReader(self.plan, self.reasoning)


def render_chat_prompt(ctx: ServingContext, req: ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None, images: bool = False
                       ) -> tuple[str, list[int]]:
    """The prompt text and token ids of ``req``'s messages (on a worker: long prompts).
    ``tools``: what the template is handed (the plan's; every tool_choice shows them).
    ``images``: the messages carry image parts (each becomes the model's placeholder).
    Anthropic's count_tokens counts exactly this."""
    documents = sum(len(v.encode("utf-8")) for d in req.documents or [] for v in d.values())
    refuse_oversized(ctx, content_bytes(req.messages) + documents, "messages",
                     truncating=req.truncate_prompt_tokens is not None)
    tok = ctx.engine.tokenizer
    template_kwargs = checked_template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:  # templates of reasoning models read it (gpt-oss)
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": req.reasoning_effort}
    try:
        messages = template_messages([m.model_dump(exclude_none=True) for m in req.messages])
        parts = {"content_parts": True} if images else {}
        text = tok.apply_chat_template(with_image_parts(messages) if images else messages,
                                       req.add_generation_prompt, tools, template_kwargs,
                                       req.continue_final_message, req.documents, **parts)
        return text, tok.encode(text, add_special_tokens=False)
    except ValueError as exc:  # no template, unsupported content parts, template errors
        raise APIError(400, str(exc), "messages") from None


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest, tag: RequestTag,
                     images: list[ImageRef] | None = None) -> ChatRun:
    """Checks ``req``, renders its prompt (on a worker) and queues it: 400s, 429s and 503s
    are raised here, before anything is answered. ``images``: ``req``'s image parts as
    the client's API names them (the Messages and Responses APIs); chat's own by default."""
    refuse_generation(ctx)
    lora = check_model(ctx, req.model)
    reject_unsupported(req, chat=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    requested_max = req.max_completion_tokens or req.max_tokens
    max_tokens = ctx.sampling_defaults.max_tokens_for(requested_max)
    check_messages(ctx.limits, len(req.messages))
    check_limits(ctx.limits, req, max_model_len=ctx.max_model_len, prompts=1,
                 max_tokens=max_tokens, logprobs=logprobs, logprobs_field="top_logprobs",
                 max_tokens_field="max_completion_tokens" if req.max_completion_tokens
                 else "max_tokens")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be "
                            "true: a continued message gets no new turn", "continue_final_message")
    plan = plan_tools(req, ctx.chat, ctx.tool_parser)
    checked_template_kwargs(req.chat_template_kwargs)  # refused here, before it queues
    vision = ctx.engine.vision
    own = image_refs(req)
    assert images is None or len(images) == len(own), "one name per image part"
    # counted and refused here; fetched on the worker
    refs = check_images(vision, own if images is None else images)
    vocab = ctx.engine.tokenizer.vocab_size
    params = build_sampling_params(req, requested_max, logprobs, vocab,
                                   prompt_logprobs_of(ctx.limits, req, vocab),
                                   defaults=ctx.sampling_defaults)

    def build() -> PromptInput:  # on a worker, with the engine's checks: long prompts
        pixels = load_images(refs, vision) if refs and vision is not None else ()
        text, ids = render_chat_prompt(ctx, req, plan.tools, bool(refs))
        return PromptInput(ids, _with_tool_constraint(ctx, params, plan, text), pixels)

    # the tap reads n and max_tokens, which the tool constraint leaves as they are
    beams = beam_params(req, params.max_tokens or ctx.max_model_len, logprobs)
    stream = tapped(await submit_beam_search(ctx, tag, build, beams, lora=lora,
                                             logprobs=logprobs) if beams is not None
                    else await submit(ctx, tag, build, params.n, lora=lora),
                    request_tap(ctx, params, tag))
    return ChatRun(stream, plan, ctx.reasoning_parser, answered_model(ctx, lora))


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, tag: RequestTag
) -> Response | AsyncIterator[str]:
    run = await start_chat(ctx, req, tag)
    stream, plan, reader = run.stream, run.plan, run.reader
    response_id = f"chatcmpl-{tag.request_id}"
    echoed = _echo_text(req)
    if req.stream:
        return _stream(ctx, stream, response_id, req, reader, echoed, run.model)
    final = await accumulate(stream)

    def build() -> bytes:  # on a worker: logprobs of n=128 x 512 tokens are 1.3M entries
        choices = []
        for c in final.outputs:
            read = reader()
            parts = read.whole(c.text)
            # a forced call's message has content "" (as vLLM answers); a parsed call's or
            # a reasoning-only answer's has none
            content = parts.content or (
                "" if plan.forced and parts.tool_calls
                else None if parts.tool_calls or parts.reasoning else "")
            if echoed is not None:
                content = echoed + (content or "")
            choices.append(ChatChoice(
                index=c.index,
                message=AssistantMessage(
                    content=content,
                    reasoning=parts.reasoning or None,
                    reasoning_content=parts.reasoning or None,
                    tool_calls=[ToolCallOut(id=t.id, function=FunctionCallOut(
                        name=t.name, arguments=t.arguments)) for t in parts.tool_calls]),
                finish_reason=_finish_reason(c.finish_reason, read),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            ))
        skeleton = ChatCompletionResponse(
            id=response_id, created=created_now(), model=run.model, choices=choices,
            usage=usage(len(final.prompt_token_ids), final.num_generated_tokens,
                        cached_tokens(ctx, final)),
            system_fingerprint=system_fingerprint(ctx.model_name),
            prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
            prompt_logprobs=None if final.prompt_logprobs is None
            else ctx.logprob_format(req).prompt_logprobs(final.prompt_logprobs),
        )
        return answer_bytes(skeleton, [None if c.logprobs is None
                                       else ctx.logprob_format(req).chat_json(c.logprobs)
                                       for c in final.outputs])

    return await json_answer(ctx, tag, build)


# chat_template_kwargs may not replace what the server itself hands the template
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
    "chat_template", "return_dict", "return_tensors", "continue_final_message", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    for name in kwargs or {}:
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(400, f"chat_template_kwargs may not set {name!r}; it has its own "
                                "request field or is the server's", "chat_template_kwargs")
    return kwargs


def _with_tool_constraint(ctx: ServingContext, params: SamplingParams, plan: ToolPlan,
                          prompt_text: str) -> SamplingParams:
    """The forced tool choice's grammar as the request's constraint; with a reasoning parser
    any constraint starts after the reasoning, unless the prompt already closed it (Qwen3
    with ``enable_thinking`` off)."""
    constraint = params.structured_outputs
    if plan.constraint is not None:
        if constraint is not None:
            raise APIError(400, f"tool_choice {plan.mode!r} fixes the output to tool calls; "
                                f"{constraint.field} cannot be combined with it",
                           constraint.field)
        constraint = plan.constraint
    update: dict[str, Any] = {}
    reasoning = ctx.reasoning_parser
    if constraint is not None and reasoning is not None and \
            not prompt_text.rstrip().endswith(reasoning.end):
        constraint = constraint.model_copy(update={"start_after": reasoning.end})
    if constraint is not params.structured_outputs:
        update["structured_outputs"] = constraint
    if (plan.mode == "auto" and plan.parser is not None and plan.parser.keeps_special_tokens) \
            or (reasoning is not None and reasoning.keeps_special_tokens):
        update["skip_special_tokens"] = False  # the markers may be special tokens
    return params.model_copy(update=update) if update else params


def _echo_text(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat ``echo``: the last message's content opens the answer when that message
    has the answer's role (``assistant``, or the last role without a generation prompt);
    None without echo."""
    if not req.echo:
        return None
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content if isinstance(part, TextPart))


def _finish_reason(reason: str | None, reader: ChoiceReader) -> str | None:
    return "tool_calls" if reason == "stop" and reader.called else reason


async def _stream(ctx: ServingContext, stream: AsyncIterator[RequestOutput], response_id: str,
                  req: ChatCompletionRequest, reader: Callable[[], ChoiceReader],
                  echoed: str | None, model: str) -> AsyncIterator[str]:
    """The request's SSE chunks. vLLM's extras: with ``continuous_usage_stats`` every chunk
    carries the usage so far; with ``return_token_ids`` the first chunk carries the prompt's
    token ids and each choice its new ones."""
    n, options = req.n, req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    token_ids = req.return_token_ids
    formatter = ctx.logprob_format(req)
    created = created_now()
    outputs = aiter(stream)
    # the first chunks carry the prompt's size or ids: wait for the first output (which has
    # them) only when they must say them
    first = await anext(outputs, None) if continuous or token_ids else None

    async def all_outputs() -> AsyncIterator[RequestOutput]:
        if first is not None:
            yield first
        async for out in outputs:
            yield out

    def usage_so_far(out: RequestOutput | None, generated: int | None = None
                     ) -> dict[str, Any]:
        if not continuous or out is None:
            return {}
        done = out.num_generated_tokens if generated is None else generated
        return {"usage": usage(len(out.prompt_token_ids), done)}

    def chunk(choices: list[ChatStreamChoice],
              logprobs: list[dict[str, Any] | None] | None = None, **extra: object) -> str:
        body = ChatCompletionChunk(id=response_id, created=created, model=model,
                                   choices=choices,
                                   system_fingerprint=system_fingerprint(ctx.model_name),
                                   **extra)
        return sse_chunk(body, logprobs)

    for i in range(n):
        prompt_ids = ({"prompt_token_ids": list(first.prompt_token_ids)}
                      if token_ids and first is not None and i == 0 else {})
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                    **usage_so_far(first, generated=0), **prompt_ids)
    if echoed:  # vLLM's echo: the last message's content, before anything generated
        for i in range(n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(content=echoed))],
                        **usage_so_far(first, generated=0))
    readers = [reader() for _ in range(n)]
    final: RequestOutput | None = None
    ended: set[int] = set()
    async for out in all_outputs():
        final = out
        choices = []
        logprobs: list[dict[str, Any] | None] = []
        for c in out.outputs:
            if c.index in ended:
                continue  # it stays finished in later outputs of an n > 1 request
            read = readers[c.index]
            parts = read.feed(c.text) if c.text else DeltaParts()
            if c.finish_reason:
                ended.add(c.index)
                tail = read.finish()
                parts = DeltaParts(parts.reasoning + tail.reasoning,
                                   parts.content + tail.content,
                                   parts.tool_calls + tail.tool_calls)
            if not (parts or c.finish_reason or c.logprobs):
                continue  # nothing to send yet (text held back: a stop string, a tag...)
            choices.append(ChatStreamChoice(
                index=c.index,
                delta=_delta(parts),
                finish_reason=_finish_reason(c.finish_reason, read),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if token_ids else None,
            ))
            logprobs.append(formatter.chat_dict(c.logprobs) if c.logprobs else None)
        # one choice per chunk, as vLLM streams n > 1 (clients index chunk.choices[0])
        for choice, choice_logprobs in zip(choices, logprobs):
            yield chunk([choice], [choice_logprobs], **usage_so_far(out))
    if include_usage and final is not None:
        yield chunk([], usage=usage(len(final.prompt_token_ids), final.num_generated_tokens,
                                    cached_tokens(ctx, final)))
    yield sse("[DONE]")


def _delta(parts: DeltaParts) -> DeltaMessage:
    calls = [DeltaToolCall(index=t.index, id=t.id, type="function" if t.id else None,
                           function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
             for t in parts.tool_calls]
    # a text delta (even an empty one, as the finish chunk's) is a string, as vLLM sends it:
    # clients concatenate every chunk's content; tool-call and reasoning deltas carry none
    content = parts.content or (None if parts.tool_calls or parts.reasoning else "")
    return DeltaMessage(content=content, reasoning=parts.reasoning or None,
                        reasoning_content=parts.reasoning or None, tool_calls=calls or None)
