"""A finished generation as a Responses ``output`` and ``Response``: the message parts that
server/api/chat_output.py reads back (reasoning, text, tool calls) become output items."""

from __future__ import annotations

import time
import uuid
from typing import Any

from server.api.chat_output import MessageParts
from server.api.responses.protocol import (
    FunctionCallOut,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOut,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from server.engine.outputs import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def skeleton(req: ResponsesRequest, response_id: str, model: str,
             status: ResponseStatus) -> ResponseObject:
    """The response before any output: the request's settings echoed, as OpenAI does."""
    choice = req.tool_choice
    text = {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)} \
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}}
    return ResponseObject(
        id=response_id, created_at=int(time.time()), status=status, background=req.background,
        model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=(choice if isinstance(choice, str) or choice is None
                     else choice.model_dump()) or ("auto" if req.tools else "none"),
        parallel_tool_calls=req.parallel_tool_calls, text=text,
        previous_response_id=req.previous_response_id, store=req.store,
        metadata=req.metadata or {}, user=req.user)


def whole_items(parts: MessageParts, finish_reason: str | None,
                logprobs: list[dict[str, Any]] | None = None) -> list[OutputItem]:
    """The output items of a whole reading: the reasoning, the message (also when empty, unless
    the answer is only calls or reasoning), the calls, in the order the model wrote them.
    ``logprobs`` (include message.output_text.logprobs): every generated token's, on the
    message's text, as vLLM puts them."""
    items: list[OutputItem] = []
    if parts.reasoning:
        items.append(ReasoningOut(id=new_id("rs"), content=[ReasoningText(text=parts.reasoning)]))
    if parts.content or not (parts.tool_calls or parts.reasoning):
        items.append(OutputMessage(id=new_id("msg"), status=item_status(finish_reason),
                                   content=[OutputText(text=parts.content,
                                                       logprobs=logprobs or [])]))
    items += [FunctionCallOut(id=new_id("fc"), call_id=t.id, name=t.name, arguments=t.arguments)
              for t in parts.tool_calls]
    return items


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def finished(response: ResponseObject, final: RequestOutput, items: list[OutputItem],
             reasoning_tokens: int) -> ResponseObject:
    """``response`` with its output, usage and final status."""
    reason = final.outputs[0].finish_reason if final.outputs else None
    status = {"length": ResponseStatus.INCOMPLETE, "abort": ResponseStatus.CANCELLED}.get(
        reason or "", ResponseStatus.COMPLETED)
    prompt = len(final.prompt_token_ids)
    cached = final.metrics.num_cached_tokens if final.metrics is not None else 0
    usage = ResponseUsage(
        input_tokens=prompt, input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=final.num_generated_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=prompt + final.num_generated_tokens)
    return response.model_copy(update=dict(
        status=status, output=items, usage=usage,
        completed_at=int(time.time()) if status is ResponseStatus.COMPLETED else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens")
        if status is ResponseStatus.INCOMPLETE else None))
