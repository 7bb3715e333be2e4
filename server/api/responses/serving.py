"""``POST /v1/responses`` and the stored responses' retrieve and cancel.

A Responses request runs as the chat request it amounts to (server/api/responses/inputs.py)
through the chat path's start (server/api/serving_chat.py ``start_chat``: template, tools,
reasoning, structured outputs, admission, tracing); its output is read back by the same
readers and written as output items (whole, or as OpenAI's event stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from server.api.chat_output import ChoiceReader, DeltaParts
from server.api.errors import APIError
from server.api.responses.events import EventWriter
from server.api.responses.inputs import (
    chat_request,
    history_images,
    input_messages,
    output_messages,
    refuse_unsupported,
)
from server.api.responses.output import finished, new_id, skeleton, whole_items
from server.api.responses.protocol import (
    OutputItem,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
)
from server.api.responses.store import ResponseStore, StoredResponse
from server.api.serving import (
    RequestTag,
    ServingContext,
    accumulate,
    check_model,
    json_answer,
)
from server.api.serving_chat import ChatRun, start_chat
from server.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class ResponsesService:
    """The Responses API of one app: its store and its background generations."""

    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    async def create(self, req: ResponsesRequest, tag: RequestTag
                     ) -> Response | AsyncIterator[str]:
        ctx = self.ctx
        check_model(ctx, req.model)
        refuse_unsupported(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if not previous.response.status.finished:
                raise APIError(400, f"previous response {req.previous_response_id} is still "
                                    f"{previous.response.status.value}; wait until it "
                                    "finishes", "previous_response_id")
            history = previous.conversation
        added, images = input_messages(req)
        conversation = history + added
        run = await start_chat(ctx, chat_request(req, conversation), tag,
                               history_images(history) + images)
        response = skeleton(req, new_id("resp"), run.model, ResponseStatus.IN_PROGRESS)
        if req.background:
            entry = StoredResponse(response.model_copy(update={"status": ResponseStatus.QUEUED}),
                                   conversation)
            self.store.put(entry)
            entry.task = asyncio.create_task(self._background(entry, run, tag,
                                                              req.enable_response_messages))
            return await self._json(entry.response, tag)
        if req.stream:
            return self._stream(response, run, conversation, tag, req.enable_response_messages)
        final = await accumulate(run.stream)
        done = await ctx.workers.run(tag.client, self._finish, response, final, run.reader(),
                                     req.enable_response_messages)
        self._keep(done, conversation)
        return await self._json(done, tag)

    async def retrieve(self, response_id: str, tag: RequestTag) -> Response:
        return await self._json(self.store.get(response_id).response, tag)

    async def cancel(self, response_id: str, tag: RequestTag) -> Response:
        """Stops a background response (its engine request is aborted and its KV blocks
        freed); a cancelled one is answered as it is again."""
        entry = self.store.get(response_id)
        response = entry.response
        if not response.background:
            raise APIError(400, f"response {response_id} was not created with background: "
                                "true; only background responses can be cancelled",
                           "response_id")
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
            await asyncio.wait({entry.task})
        elif response.status is not ResponseStatus.CANCELLED:
            raise APIError(400, f"response {response_id} has already finished "
                                f"({response.status.value}); it cannot be cancelled",
                           "response_id")
        return await self._json(entry.response, tag)

    def _finish(self, response: ResponseObject, final: RequestOutput, reader: ChoiceReader,
                raw: bool = False) -> ResponseObject:
        """The whole reading of ``final`` (on a worker: parsing and counting are linear in
        the output)."""
        completion = final.outputs[0]
        parts = reader.whole(completion.text)
        logprobs = (self.ctx.logprobs.chat_dict(completion.logprobs)["content"]
                    if completion.logprobs is not None else None)
        items = whole_items(parts, completion.finish_reason, logprobs)
        return self._raw(finished(response, final, items, self._reasoning_tokens(items)),
                         final, raw)

    def _raw(self, response: ResponseObject, final: RequestOutput, raw: bool
             ) -> ResponseObject:
        """vLLM's ``enable_response_messages``: the prompt as the model read it and the
        output as it wrote it, each text (special tokens kept) with its token ids."""
        if not raw:
            return response
        decode = self.ctx.engine.tokenizer.decode

        def message(ids: list[int]) -> dict[str, Any]:
            return {"type": "raw_message_tokens",
                    "message": decode(list(ids), skip_special_tokens=False),
                    "tokens": list(ids)}

        return response.model_copy(update={
            "input_messages": [message(final.prompt_token_ids)],
            "output_messages": [message(final.outputs[0].token_ids)]})

    def _reasoning_tokens(self, items: list[OutputItem]) -> int:
        text = "".join(part.text for item in items if item.type == "reasoning"
                       for part in item.content)  # type: ignore[union-attr]
        return len(self.ctx.engine.tokenizer.encode(text, add_special_tokens=False)) \
            if text else 0

    def _keep(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        if response.store:
            self.store.put(StoredResponse(response,
                                          conversation + output_messages(response.output)))

    async def _json(self, response: ResponseObject, tag: RequestTag) -> Response:
        return await json_answer(self.ctx, tag,
                                 lambda: response.model_dump_json().encode("utf-8"))

    async def _stream(self, response: ResponseObject, run: ChatRun,
                      conversation: list[dict[str, Any]], tag: RequestTag, raw: bool = False
                      ) -> AsyncIterator[str]:
        writer = EventWriter()
        yield writer.lifecycle("response.created", response)
        yield writer.lifecycle("response.in_progress", response)
        reader = run.reader()
        final: RequestOutput | None = None
        async for out in run.stream:
            if final is None:
                final = out
            else:
                final.add(out)
            completion = out.outputs[0]
            parts = reader.feed(completion.text) if completion.text else DeltaParts()
            if completion.finish_reason:
                tail = reader.finish()
                parts = DeltaParts(parts.reasoning + tail.reasoning,
                                   parts.content + tail.content,
                                   parts.tool_calls + tail.tool_calls)
            if completion.logprobs:  # a few tokens: formatted here, as chat's chunks are
                writer.add_logprobs(self.ctx.logprobs.chat_dict(completion.logprobs)["content"])
            for event in writer.feed(parts):
                yield event
        assert final is not None, "an engine stream ends with a finished output"
        reason = final.outputs[0].finish_reason
        for event in writer.finish(reason):
            yield event
        done = finished(response, final, writer.items,
                        await self.ctx.workers.run(tag.client, self._reasoning_tokens,
                                                   writer.items))
        done = await self.ctx.workers.run(tag.client, self._raw, done, final, raw)
        self._keep(done, conversation)
        kind = "response.incomplete" if done.status is ResponseStatus.INCOMPLETE \
            else "response.completed"
        yield await self.ctx.workers.run(tag.client, writer.lifecycle, kind, done)

    async def _background(self, entry: StoredResponse, run: ChatRun, tag: RequestTag,
                          raw: bool = False) -> None:
        """Generates a background response detached from its request; its entry says how far
        it got (queued, in_progress, then its final status)."""
        final: RequestOutput | None = None
        try:
            async for out in run.stream:
                if final is None:
                    final = out
                    entry.response = entry.response.model_copy(
                        update={"status": ResponseStatus.IN_PROGRESS})
                else:
                    final.add(out)
            assert final is not None
            done = await self.ctx.workers.run(tag.client, self._finish, entry.response, final,
                                              run.reader(), raw)
            entry.response = done
            entry.conversation = entry.conversation + output_messages(done.output)
        except asyncio.CancelledError:  # POST /v1/responses/{id}/cancel
            entry.response = entry.response.model_copy(
                update={"status": ResponseStatus.CANCELLED})
        except Exception as exc:  # noqa: BLE001 - recorded in the response, as OpenAI does
            logger.exception("background response %s failed", entry.response.id)
            entry.response = entry.response.model_copy(update={
                "status": ResponseStatus.FAILED,
                "error": ResponseError(code="server_error", message=str(exc))})
        finally:
            self.store.finished(entry)
            with contextlib.suppress(Exception):
                await run.stream.aclose()  # type: ignore[attr-defined]

