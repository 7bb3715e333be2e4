"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic request becomes the chat
request it amounts to (convert.py), which the chat path checks, renders, queues and reads
back (server/api/serving_chat.py); the answer is written in Anthropic's terms."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import Response

from server.api.answer_json import dumps
from server.api.anthropic.answer import content_blocks, stop_reason, usage
from server.api.anthropic.convert import check_thinking, image_refs, to_chat_request
from server.api.anthropic.events import message_events
from server.api.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from server.api.errors import APIError
from server.api.media.chat import check_images
from server.api.request_checks import check_messages
from server.api.serving import RequestTag, ServingContext, accumulate, check_model, json_answer
from server.api.serving_chat import render_chat_prompt, start_chat
from server.api.tools import template_tools


async def create_message(ctx: ServingContext, req: MessagesRequest, tag: RequestTag
                         ) -> Response | AsyncIterator[str]:
    check_model(ctx, req.model)
    show_thinking = _show_thinking(ctx, req)
    chat = to_chat_request(req)
    run = await start_chat(ctx, chat, tag, image_refs(req, chat))
    message_id = f"msg_{tag.request_id}"
    if req.stream:
        return message_events(run, message_id, run.model, show_thinking)
    final = await accumulate(run.stream)

    def build() -> bytes:  # on a worker, as every answer is serialized
        completion = final.outputs[0]
        read = run.reader()
        parts = read.whole(completion.text)
        reason, sequence = stop_reason(completion, read.called)
        message = MessageResponse(
            id=message_id, model=run.model, content=content_blocks(parts, show_thinking),
            stop_reason=reason, stop_sequence=sequence,
            usage=usage(final, final.num_generated_tokens))
        return dumps(message.model_dump()).encode("utf-8")

    return await json_answer(ctx, tag, build)


async def count_tokens(ctx: ServingContext, req: CountTokensRequest, tag: RequestTag
                       ) -> Response:
    """The prompt's tokens: the same template, tools and tokenizer as /v1/messages."""
    check_model(ctx, req.model)
    _show_thinking(ctx, req)
    chat = to_chat_request(req)
    images = check_images(ctx.engine.vision, image_refs(req, chat))
    if images:  # an image's token count is the processor's, which runs in the engine
        raise APIError(400, "count_tokens does not count image blocks yet; count the text "
                            "alone, or read the usage of /v1/messages", images[0].param,
                       "unsupported_parameter")
    check_messages(ctx.limits, len(chat.messages))
    tools = template_tools(chat) or None

    def count() -> bytes:  # on a worker: a long prompt takes seconds to tokenize
        _, ids = render_chat_prompt(ctx, chat, tools)
        return dumps(CountTokensResponse(input_tokens=len(ids)).model_dump()).encode("utf-8")

    return await json_answer(ctx, tag, count)


def _show_thinking(ctx: ServingContext, req: CountTokensRequest) -> bool:
    """Whether thinking blocks carry their text (all but ``display: "omitted"``); 400 for
    thinking the server cannot serve."""
    check_thinking(req, ctx.reasoning_parser is not None)
    return req.thinking is None or req.thinking.display != "omitted"
