"""Request logs (``--enable-log-requests``): one line per API request when it has been answered.

The line names the request (its X-Request-Id), its sizes (prompts, prompt and completion
tokens, ``n``), its sampling parameters and its outcome (HTTP status, finish reasons, error
code, latency). Texts (prompts, outputs, stop strings) are left out unless ``--log-prompts``
is given, and then cut at ``--max-log-len``.

The middleware opens a :class:`RequestRecord` per request and writes the line once the
response has gone; :class:`LoggedEngine` (the engine as the handlers see it) fills the
record in as the request's prompts are built and its outputs flow. The record travels in a
context variable, so the handlers need not know about it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from server.config import LoggingConfig
from server.engine.inputs import Offload, PromptBuilder, PromptInput
from server.engine.outputs import RequestOutput
from server.engine.sampling_params import SamplingParams
from server.log import FIELDS

logger = logging.getLogger(__name__)

# Only generation and token requests are logged: health checks and scrapes would drown them.
LOGGED_PATHS = ("/v1/", "/tokenize", "/detokenize")
# Sampling parameters named on every line (the rest only where not at their default).
ALWAYS = {"n", "max_tokens", "temperature", "top_p"}
# Parameters that hold user text or long lists: counted unless --log-prompts.
BULKY = {"stop", "stop_token_ids", "logit_bias", "structured_outputs", "bad_words",
         "bad_words_token_ids"}


@dataclass
class RequestRecord:
    """What is known of one API request so far."""

    request_id: str
    method: str
    path: str
    start: float = field(default_factory=time.monotonic)
    status: int | None = None
    error_code: str | None = None
    params: dict[str, Any] | None = None
    n: int | None = None
    prompts: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    failure: str | None = None  # an engine stream that ended in an exception
    prompt_texts: list[str] = field(default_factory=list)  # only with --log-prompts
    output_texts: dict[tuple[str, int], str] = field(default_factory=dict)

    def answered(self, body: bytes) -> None:
        """Picks the error code out of an error answer's (small) JSON body."""
        if self.status is None or self.status < 400 or self.error_code is not None:
            return
        try:
            self.error_code = str(json.loads(body)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            self.error_code = "unknown"


_record: ContextVar[RequestRecord | None] = ContextVar("hpu_serve_request_record",
                                                       default=None)


class RequestLog:
    """Opens and writes the records (the middleware's side)."""

    def __init__(self, cfg: LoggingConfig) -> None:
        self.with_text = cfg.log_prompts
        self.max_len = cfg.max_log_len

    @contextlib.contextmanager
    def logged(self, request_id: str, method: str, path: str
               ) -> Iterator[RequestRecord | None]:
        """The request's record (None if it is not logged), bound to the current context
        inside; its line is written on the way out, whatever ended the request."""
        if not path.startswith(LOGGED_PATHS) or method == "OPTIONS":
            yield None
            return
        record = RequestRecord(request_id, method, path)
        token = _record.set(record)
        try:
            yield record
        finally:
            _record.reset(token)
            self.write(record)

    def write(self, record: RequestRecord) -> None:
        fields: dict[str, Any] = {
            "request_id": record.request_id, "method": record.method, "path": record.path,
            "status": record.status if record.status is not None else 499,
            "latency_s": round(time.monotonic() - record.start, 4),
        }
        if record.prompts:
            fields.update(prompts=record.prompts, prompt_tokens=record.prompt_tokens,
                          completion_tokens=record.completion_tokens, n=record.n,
                          finish_reasons=record.finish_reasons, params=record.params)
        if record.error_code is not None:
            fields["error_code"] = record.error_code
        if record.failure is not None:
            fields["failure"] = record.failure
        if self.with_text and record.prompts:
            fields["prompt"] = record.prompt_texts
            fields["output"] = [self.cut(t) for t in record.output_texts.values()]
        level = logging.WARNING if fields["status"] >= 500 else logging.INFO
        logger.log(level, "Finished request %s", record.request_id, extra={FIELDS: fields})

    def cut(self, text: str) -> str:
        """``text`` within ``--max-log-len`` characters."""
        return text if self.max_len is None else text[: self.max_len]

    def params_of(self, params: SamplingParams) -> dict[str, Any]:
        data = params.model_dump(exclude=BULKY)
        shown = {k: v for k, v in data.items()
                 if k in ALWAYS or v != SamplingParams.model_fields[k].default}
        for name in ("stop", "stop_token_ids", "logit_bias", "bad_words"):
            value = getattr(params, name)
            if value:
                shown[name] = value if self.with_text else len(value)
        if params.structured_outputs is not None:
            shown["structured_outputs"] = params.structured_outputs.kind
        return shown


class LoggedEngine:
    """The engine as the handlers see it with ``--enable-log-requests``: ``submit`` notes
    each prompt and its outputs in the request's record; everything else is the engine's."""

    def __init__(self, engine: Any, log: RequestLog) -> None:
        self._engine = engine
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def submit(self, request_id: str, prompt: str | list[int] | PromptBuilder,
                     params: SamplingParams | None = None, client: str = "",
                     offload: Offload | None = None, lora_request: Any = None
                     ) -> AsyncIterator[RequestOutput]:
        record = _record.get()
        if record is None:
            return await self._engine.submit(request_id, prompt, params, client, offload,
                                             lora_request=lora_request)
        build = prompt if callable(prompt) else _builder(prompt, params)

        def noted() -> PromptInput:  # on a worker thread, while the request is built
            given = build()
            self._note(record, given)
            return given

        stream = await self._engine.submit(request_id, noted, client=client, offload=offload,
                                           lora_request=lora_request)
        return _observed(stream, record, self._log.with_text)

    def _note(self, record: RequestRecord, given: PromptInput) -> None:
        record.prompts += 1
        record.n = given.params.n
        if record.params is None:
            record.params = self._log.params_of(given.params)
        if self._log.with_text:  # the prompt as the model reads it (a chat: templated)
            prompt = given.prompt
            text = prompt if isinstance(prompt, str) else self._engine.tokenizer.decode(prompt)
            record.prompt_texts.append(self._log.cut(text))


def _builder(prompt: str | list[int], params: SamplingParams | None) -> PromptBuilder:
    given = PromptInput(prompt, params or SamplingParams())
    return lambda: given


async def _observed(stream: AsyncIterator[RequestOutput], record: RequestRecord,
                    with_text: bool) -> AsyncIterator[RequestOutput]:
    """The stream, counted into ``record`` as it flows (on the event loop)."""
    first = True
    iterator = stream.__aiter__()
    try:
        async for out in iterator:
            if first:
                first = False
                record.prompt_tokens += len(out.prompt_token_ids)
            if with_text:
                for c in out.outputs:
                    key = (out.request_id, c.index)
                    record.output_texts[key] = record.output_texts.get(key, "") + c.text
            if out.finished:
                record.completion_tokens += out.num_generated_tokens
                record.finish_reasons += [c.finish_reason or "abort" for c in out.outputs]
            yield out
    except Exception as exc:
        record.failure = type(exc).__name__
        raise
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
