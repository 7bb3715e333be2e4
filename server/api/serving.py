"""Shared serving logic: model checks, OpenAI fields -> SamplingParams, engine streams."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from starlette.responses import Response

import server
from server.api.admission import AdmittedStream, ClientSeqs
from server.api.answer_json import LOGPROB_FLOOR, LogprobFormatter, json_logprob
from server.api.errors import APIError, error_body, stream_error
from server.api.protocol import (
    ChatMessage,
    PromptTokensDetails,
    SamplingFields,
    TextPart,
    UsageInfo,
)
from server.api.reasoning_parsers import ReasoningParser
from server.api.structured import structured_outputs_of
from server.api.tool_parsers import ToolParser
from server.api.tracing import RequestTracer, TraceHook
from server.api.workers import BIG_REQUEST_BYTES, PreprocessPool
from server.config import ChatOptions, RequestLimits
from server.engine.inputs import Offload, PromptBuilder
from server.engine.lora.request import LoRARequest
from server.engine.multimodal.inputs import VisionInfo
from server.engine.outputs import EngineStats, RequestOutput
from server.engine.pooling.params import PoolingModelInfo
from server.engine.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from server.engine.sampling_params import SamplingParams
from server.engine.tokenizer import Tokenizer
from server.metrics import ServerMetrics


class EngineClient(Protocol):
    """Everything the API needs from the engine (``AsyncEngine`` provides it; the serving
    tests use a fake)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def pooling(self) -> PoolingModelInfo | None:
        """The served pooling model (``--runner pooling``); None when it generates."""

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What a request's unset sampling fields become (--generation-config)."""

    @property
    def vision(self) -> VisionInfo | None:
        """A vision-language model's image rules (None: the model reads text only)."""

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """The device layer's series (compilations, bucket misses...), for /metrics."""

    @property
    def is_alive(self) -> bool: ...

    def start(self) -> None:
        """Binds to the running event loop (the app's startup)."""

    async def shutdown(self) -> None: ...

    async def submit(self, request_id: str, prompt: str | list[int] | PromptBuilder,
                     params: SamplingParams | None = None, client: str = "",
                     offload: Offload | None = None, lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """Queues a request: ``prompt`` is built (if a builder), tokenized and checked in
        one job run by ``offload``; ``lora_request``: the adapter it runs with."""

    def lora_adapter(self, name: str) -> LoRARequest | None:
        """The adapter served under ``name`` (--enable-lora), if any."""

    def lora_adapters(self) -> list[LoRARequest]:
        """Every adapter served by name, for /v1/models."""

    def abort(self, request_id: str) -> None: ...

    def stalled_for(self) -> float:
        """Seconds the engine has had work without making progress (0.0: it is fine)."""

    async def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; the number of blocks that were cached."""

    def stats(self) -> EngineStats: ...

    def observed_shapes(self) -> dict[str, Any]:
        """The engine's histogram of unpadded step shapes and per-bucket warmup seconds, as
        JSON-ready data (``GET /buckets/observed``)."""


@dataclass(frozen=True, slots=True)
class ServingContext:
    """Per-app facts the handlers need, built once by the app factory."""

    engine: EngineClient
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    max_waiting_requests: int  # 0 = unbounded
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)
    tool_parser: type[ToolParser] | None = None  # --tool-call-parser
    reasoning_parser: type[ReasoningParser] | None = None  # --reasoning-parser
    # --preprocess-workers: tokenizing, templates, logprobs, big answers (never the loop)
    workers: PreprocessPool = field(default_factory=lambda: PreprocessPool(4))
    # sequences per client (--max-client-seqs) and the fair share of the waiting queue
    clients: ClientSeqs = field(default_factory=ClientSeqs)
    # --otlp-traces-endpoint: a span per request (None: tracing off)
    tracer: RequestTracer | None = None
    # --enable-prompt-tokens-details: usage reports the prompt tokens the cache served
    prompt_tokens_details: bool = False
    # --generation-config: the model's defaults for the sampling fields a request leaves
    # unset; every endpoint's build_sampling_params takes them
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    # the engine's tokenizer's logprob texts, cached per token id
    logprobs: LogprobFormatter = field(init=False)
    logprobs_as_ids: LogprobFormatter = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "logprobs",
                           LogprobFormatter(self.engine.tokenizer.token_str))
        object.__setattr__(self, "logprobs_as_ids", LogprobFormatter(_token_id_str))

    def logprob_format(self, req: SamplingFields) -> LogprobFormatter:
        """The request's logprob texts: the tokens', or vLLM's ``token_id:N`` with
        ``return_tokens_as_token_ids`` (tokens that are no valid UTF-8 alone stay exact)."""
        return self.logprobs_as_ids if req.return_tokens_as_token_ids else self.logprobs


@dataclass(frozen=True, slots=True)
class RequestTag:
    """Who asked. ``request_id`` is what the client sees (its X-Request-Id, or a fresh one):
    response ids, logs. The engine gets ids made unique by ``nonce``, so two requests with the
    same X-Request-Id never share or cross-wire a stream, and learn nothing of each other.
    ``client`` is the --fair-share key."""

    request_id: str
    client: str = "addr:unknown"
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # the W3C trace-context headers it came with (traceparent, tracestate): its span's parent
    trace_headers: tuple[tuple[str, str], ...] = ()

    def engine_id(self, index: int | None = None) -> str:
        base = f"{self.request_id}-{self.nonce}"
        return base if index is None else f"{base}-{index}"


def check_model(ctx: ServingContext, name: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model); 404 if neither."""
    if name is None or name == ctx.model_name:
        return None
    lora = ctx.engine.lora_adapter(name)
    if lora is None:
        raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
    return lora


def answered_model(ctx: ServingContext, lora: LoRARequest | None) -> str:
    """What an answer's ``model`` says: the adapter that served it (vLLM names the adapter),
    else the base model."""
    return lora.lora_name if lora is not None else ctx.model_name


def refuse_generation(ctx: ServingContext) -> None:
    """A pooling server refuses text generation (chat, completions, and the Responses and
    Messages APIs built on them) with a 400 naming ``--runner``."""
    if ctx.engine.pooling is not None:
        raise APIError(400, "this server runs a pooling model (--runner pooling): it serves "
                            "/v1/embeddings, /pooling, /classify, /score and /rerank, not "
                            "text generation", "model", "invalid_request_error")


__all__ = ["LOGPROB_FLOOR", "json_logprob"]  # re-exported: their home is answer_json


def content_bytes(messages: list[ChatMessage]) -> int:
    """UTF-8 bytes of the text a chat template must copy into the prompt. Assistant turns
    are left out: a template may drop their reasoning from the history."""
    total = 0
    for m in messages:
        if m.role == "assistant":
            continue
        if isinstance(m.content, str):
            total += len(m.content.encode("utf-8"))
        elif m.content:
            total += sum(len(part.text.encode("utf-8")) for part in m.content
                         if isinstance(part, TextPart))
    return total


def refuse_oversized(ctx: ServingContext, text_bytes: int, field_name: str,
                     leave: int = 1, truncating: bool = False) -> None:
    """400 without tokenizing when ``text_bytes`` of text provably hold more tokens than
    the context (less ``leave`` tokens) allows: no token stands for more bytes than the
    tokenizer's longest. Call it on a worker (the bound is computed once, on first use).
    ``truncating``: the request keeps only its prompt's last tokens, so length is no bound."""
    per_token = ctx.engine.tokenizer.max_token_bytes
    if per_token is None or truncating:
        return
    at_least = -(-text_bytes // per_token)
    if at_least > ctx.max_model_len - leave:
        raise APIError(
            400, f"This model's maximum context length is {ctx.max_model_len} tokens, but "
                 f"the text of {field_name} alone holds at least {at_least} tokens "
                 f"({text_bytes} bytes, at most {per_token} bytes per token); shorten it.",
            field_name)


@functools.lru_cache(maxsize=8)
def system_fingerprint(model_name: str) -> str:
    """OpenAI's ``system_fingerprint``: changes when the server version or the model does, so
    that a client comparing seeded outputs knows when the backend changed."""
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:8]
    return f"fp_hpu-serve-{server.__version__}-{digest}"


def build_sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int,
    prompt_logprobs: int | None = None, *, defaults: SamplingDefaults,
) -> SamplingParams:
    """OpenAI/vLLM request fields -> engine params; bad values surface as pydantic errors
    naming the field (answered with 400). ``defaults`` (``ctx.sampling_defaults``, from
    --generation-config) fill the sampling fields and max_tokens the request leaves unset
    (pass ``max_tokens`` as the request has it: None when unset)."""
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from None
    temperature = req.temperature
    top_p = req.top_p
    if top_p == 0.0:  # OpenAI: only the most likely token (the engine takes top_p in (0, 1])
        temperature, top_p = 0.0, None
    sampling = defaults.fill(dict(temperature=temperature, top_p=top_p, top_k=req.top_k,
                                  min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                                  max_tokens=max_tokens))
    top_k = sampling["top_k"]
    if top_k is not None and top_k >= vocab_size:
        top_k = 0  # every token is in the top k: disabled, as vLLM clamps it to the vocabulary
    fields: dict[str, Any] = dict(
        n=req.n, max_tokens=sampling["max_tokens"], min_tokens=req.min_tokens, seed=req.seed,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=bias, logprobs=logprobs, stop=req.stop,
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, priority=req.priority,
        cache_salt=req.cache_salt, truncate_prompt_tokens=req.truncate_prompt_tokens,
        truncation_side=req.truncation_side or "left",
        allowed_token_ids=req.allowed_token_ids, prompt_logprobs=prompt_logprobs,
        bad_words=req.bad_words or [],
    )
    optional = dict(temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=top_k,
                    min_p=sampling["min_p"], repetition_penalty=sampling["repetition_penalty"],
                    structured_outputs=structured_outputs_of(req))
    fields.update({k: v for k, v in optional.items() if v is not None})
    return SamplingParams(**fields)


async def submit(ctx: ServingContext, tag: RequestTag, build: PromptBuilder, n: int,
                 index: int | None = None, lora: LoRARequest | None = None
                 ) -> AsyncIterator[RequestOutput]:
    """Queues one prompt's request of ``n`` sequences, which count against the client until
    its stream ends (429 past --max-client-seqs, 503 once the waiting queue is full).
    ``build`` makes the prompt (renders a template, tokenizes text): the engine runs it with
    its own checks as the request's one job on the preprocess pool, in the client's share."""
    num_waiting = ctx.engine.stats().num_waiting if ctx.max_waiting_requests else 0
    lease = ctx.clients.admit(tag.client, n, num_waiting, ctx.max_waiting_requests)
    try:
        stream = await ctx.engine.submit(tag.engine_id(index), build, client=tag.client,
                                         offload=ctx.workers.offload(tag.client),
                                         lora_request=lora)
    except BaseException:
        lease.release()
        raise
    return AdmittedStream(stream, lease)


def request_tap(ctx: ServingContext, params: SamplingParams, tag: RequestTag,
                index: int | None = None) -> MetricsTap:
    """The tap of one engine request: its metrics, and its span when tracing is on."""
    trace = None if ctx.tracer is None else ctx.tracer.hook(
        tag.request_id, dict(tag.trace_headers), params, index)
    return MetricsTap(ctx.metrics, params, trace)


class MetricsTap:
    """Records token counters and latencies as one request's outputs flow past; ``trace``
    gets the final output."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams,
                 trace: TraceHook | None = None) -> None:
        self.metrics = metrics
        self.params = params
        self.trace = trace
        self.last_token_time: float | None = None
        self.started = False

    def observe(self, out: RequestOutput) -> None:
        m = self.metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if not self.started:
            self.started = True
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.metrics is not None and out.metrics.first_token_time is not None:
                m.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
        elif new_tokens and out.metrics is not None and self.last_token_time is not None:
            assert out.metrics.last_token_time is not None
            m.itl.observe(out.metrics.last_token_time - self.last_token_time)
        if out.metrics is not None:
            self.last_token_time = out.metrics.last_token_time
        m.generation_tokens.inc(new_tokens)
        if out.finished:
            m.record_finished(out, self.params.n, self.params.max_tokens)
            if self.trace is not None:
                self.trace(out)


async def tapped(stream: AsyncIterator[RequestOutput], tap: MetricsTap
                 ) -> AsyncIterator[RequestOutput]:
    finished = False
    try:
        async for out in stream:
            tap.observe(out)
            finished = out.finished
            yield out
    finally:
        if not finished:  # the client left (or the engine failed): the request was aborted
            tap.metrics.request_success.labels(tap.metrics.model_name, "abort").inc()


async def accumulate(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The whole result of a request from its stream of deltas (a non-streamed answer)."""
    result: RequestOutput | None = None
    async for out in stream:
        if result is None:
            result = out
        else:
            result.add(out)
    assert result is not None, "an engine stream ends with a finished output"
    return result


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' outputs (a completions call with many prompts)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # a departed client aborts every prompt's request


async def guarded_sse(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE body that ends properly even when the request fails mid-stream: the headers
    (200) are gone by then, so the error travels as a last ``data: {"error": ...}`` event,
    followed by ``[DONE]``, as vLLM does."""
    try:
        async for item in chunks:
            yield item
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        status, message = stream_error(exc)
        yield sse(json.dumps(error_body(status, message), ensure_ascii=False))
        yield sse("[DONE]")


async def json_answer(ctx: ServingContext, tag: RequestTag, build: Callable[[], bytes]
                      ) -> Response:
    """A non-streamed answer, assembled and serialized on a worker (``build``): a big one
    (n=128 with logprobs is ~100 MB of JSON) never holds the event loop."""
    body = await ctx.workers.run(tag.client, build)
    if len(body) >= BIG_REQUEST_BYTES:
        ctx.workers.trim_soon()
    return Response(body, media_type="application/json")


def _token_id_str(token_id: int) -> str:
    return f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> UsageInfo:
    """``cached_tokens``: with --enable-prompt-tokens-details, the prompt tokens the prefix
    cache served (None: the details are left out)."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=details)


def cached_tokens(ctx: ServingContext, *outputs: RequestOutput) -> int | None:
    """The prompt tokens of ``outputs`` served from the prefix cache, when the usage reports
    them (--enable-prompt-tokens-details)."""
    if not ctx.prompt_tokens_details:
        return None
    return sum(o.metrics.num_cached_tokens for o in outputs if o.metrics is not None)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_chunk(body: BaseModel, logprobs: list[dict[str, Any] | None] | None = None) -> str:
    """A stream chunk as OpenAI writes it: unset optional fields left out, except that every
    choice states its ``finish_reason`` (null until the last chunk). ``logprobs``: plain
    dicts put into the choices (aligned with them), not pydantic objects."""
    data = body.model_dump(exclude_none=True)
    for i, choice in enumerate(data.get("choices", [])):
        choice.setdefault("finish_reason", None)
        choice.setdefault("logprobs", logprobs[i] if logprobs else None)
    # allow_nan=False: a NaN must fail the stream (an error event), never go out as
    # "NaN", which no JSON parser accepts
    return sse(json.dumps(data, ensure_ascii=False, allow_nan=False))


def created_now() -> int:
    return int(time.time())
