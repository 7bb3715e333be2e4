"""The pooling endpoints' logic: every input is one engine request (admitted, tokenized on a
worker and batched by the engine like any other); answers are serialized on a worker."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable, Sequence

from starlette.responses import Response

from server.api.answer_json import dumps
from server.api.errors import APIError
from server.api.pooling.checks import reject_unsupported
from server.api.pooling.protocol import (
    SCORE_SPELLINGS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreSide,
)
from server.api.serving import RequestTag, ServingContext, check_model, merge, submit
from server.api.tools import template_messages
from server.engine.inputs import PromptBuilder, PromptInput
from server.engine.pooling.outputs import PoolingRequestOutput
from server.engine.pooling.params import PoolingModelInfo, PoolingParams, PoolingTask

# inputs in one request (OpenAI's bound for embeddings)
MAX_INPUTS = 2048


class JSONBytes(Response):
    media_type = "application/json"


def pooling_info(ctx: ServingContext) -> PoolingModelInfo:
    """The served pooling model; a 400 naming ``--runner`` on a generative server."""
    info = ctx.engine.pooling
    if info is None:
        raise APIError(400, "this endpoint needs a pooling model: the server generates text "
                            "(start it with --runner pooling and an embedding, reranking or "
                            "classification model)", "model", "invalid_request_error")
    return info


def _inputs(value: object, field: str) -> list[str | list[int]]:
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        items = [value]  # type: ignore[list-item]
    elif isinstance(value, list):
        items = list(value)
    else:
        items = []
    if not items or any(len(i) == 0 for i in items):
        raise APIError(400, f"{field} must be non-empty (a string, token ids, or a list of "
                            "them, none empty)", field)
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"{field} has {len(items)} items, at most {MAX_INPUTS} are "
                            "allowed in one request", field)
    return items


def _given(prompt: str | list[int], params: PoolingParams) -> PromptBuilder:
    given = PromptInput(prompt, params)
    return lambda: given


async def _pool(ctx: ServingContext, tag: RequestTag,
                builders: Sequence[PromptBuilder]) -> list[PoolingRequestOutput]:
    """Runs every builder's input as its own engine request; results in input order."""
    many = len(builders) > 1
    streams = []
    try:
        for i, build in enumerate(builders):
            streams.append(await submit(ctx, tag, build, 1, index=i if many else None))
    except BaseException:
        for i in range(len(streams)):
            ctx.engine.abort(tag.engine_id(i if many else None))
        raise
    results: dict[int, PoolingRequestOutput] = {}
    async for i, out in merge(streams):
        assert isinstance(out, PoolingRequestOutput), type(out)
        results[i] = out
    return [results[i] for i in range(len(builders))]


def _usage(outputs: Sequence[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    """OpenAI's base64: the float32 little-endian bytes of the vector."""
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def _embedding_builders(ctx: ServingContext, req: EmbeddingRequest,
                        params: PoolingParams) -> list[PromptBuilder]:
    if req.messages is not None:
        if req.input is not None:
            raise APIError(400, "give either input or messages, not both", "messages")
        tok = ctx.engine.tokenizer
        messages = template_messages([m.model_dump(exclude_none=True) for m in req.messages])

        def render() -> PromptInput:  # on a worker: templates cost what the input costs
            try:
                text = tok.apply_chat_template(messages, req.add_generation_prompt,
                                               template_kwargs=req.chat_template_kwargs)
            except ValueError as exc:
                raise APIError(400, str(exc), "messages") from None
            return PromptInput(tok.encode(text, add_special_tokens=False), params)

        return [render]
    if req.input is None:
        raise APIError(400, "input is required", "input")
    tok = ctx.engine.tokenizer
    builders = []
    for item in _inputs(req.input, "input"):
        if isinstance(item, str) and not req.add_special_tokens:
            builders.append(lambda item=item: PromptInput(
                tok.encode(item, add_special_tokens=False), params))
        else:
            builders.append(_given(item, params))
    return builders


def _embed_params(info: PoolingModelInfo, req: EmbeddingRequest) -> PoolingParams:
    if req.dimensions is not None and info.matryoshka_dimensions is None:
        raise APIError(400, "dimensions is not supported: this model is not a Matryoshka "
                            "model (its config names no matryoshka_dimensions)", "dimensions")
    normalize = req.normalize if req.normalize is not None else req.use_activation
    return PoolingParams(PoolingTask.EMBED, req.dimensions, normalize,
                         req.truncate_prompt_tokens)


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest,
                           tag: RequestTag) -> Response:
    info = pooling_info(ctx)
    check_model(ctx, req.model)
    reject_unsupported(req, encoded=True, chat=req.messages is not None)
    if PoolingTask.EMBED not in info.tasks:
        raise APIError(400, "this model is a classifier: use /classify, /score or /rerank "
                            "(or serve it with --convert embed)", "model")
    outputs = await _pool(ctx, tag, _embedding_builders(ctx, req, _embed_params(info, req)))

    def build() -> bytes:
        return EmbeddingResponse(
            id=f"embd-{tag.request_id}", model=ctx.model_name,
            data=[EmbeddingData(index=i, embedding=_encode(o.data, req.encoding_format))
                  for i, o in enumerate(outputs)],
            usage=_usage(outputs)).model_dump_json().encode()

    return JSONBytes(await ctx.workers.run(tag.client, build))


async def create_pooling(ctx: ServingContext, req: EmbeddingRequest,
                         tag: RequestTag) -> Response:
    """vLLM's ``/pooling``: the model's pooled output, whatever its task (an embedding, or a
    classifier's probabilities)."""
    info = pooling_info(ctx)
    check_model(ctx, req.model)
    reject_unsupported(req, encoded=True, chat=req.messages is not None)
    if PoolingTask.EMBED in info.tasks:
        params = _embed_params(info, req)
    else:
        params = PoolingParams(PoolingTask.CLASSIFY,
                               truncate_prompt_tokens=req.truncate_prompt_tokens,
                               activation=req.use_activation is not False)
    outputs = await _pool(ctx, tag, _embedding_builders(ctx, req, params))

    def build() -> bytes:
        return PoolingResponse(
            id=f"pool-{tag.request_id}", model=ctx.model_name,
            data=[PoolingData(index=i, data=_encode(o.data, req.encoding_format))
                  for i, o in enumerate(outputs)],
            usage=_usage(outputs)).model_dump_json().encode()

    return JSONBytes(await ctx.workers.run(tag.client, build))


async def create_classification(ctx: ServingContext, req: ClassificationRequest,
                                tag: RequestTag) -> Response:
    info = pooling_info(ctx)
    check_model(ctx, req.model)
    if PoolingTask.CLASSIFY not in info.tasks:
        raise APIError(400, "this model has no classification head (/classify needs a "
                            "*ForSequenceClassification model)", "model")
    reject_unsupported(req)
    if req.input is None:
        raise APIError(400, "input is required", "input")
    params = PoolingParams(PoolingTask.CLASSIFY,
                           truncate_prompt_tokens=req.truncate_prompt_tokens,
                           activation=req.use_activation is not False)
    outputs = await _pool(ctx, tag, [_given(i, params) for i in _inputs(req.input, "input")])
    data = []
    for i, o in enumerate(outputs):
        best = max(range(len(o.data)), key=o.data.__getitem__)
        data.append(ClassificationData(index=i, label=info.id2label.get(best), probs=o.data,
                                       num_classes=len(o.data)))
    return JSONBytes(ClassificationResponse(
        id=f"classify-{tag.request_id}", model=ctx.model_name, data=data,
        usage=_usage(outputs)).model_dump_json().encode())


def _score_sides(req: ScoreRequest) -> tuple[tuple[str, ScoreSide], tuple[str, ScoreSide]]:
    """The two sides of a /score request with the names the client gave them: exactly one of
    vLLM's spellings, whole (a mix such as ``queries`` with ``text_2`` is ambiguous)."""
    names = dict.fromkeys(n for pair in SCORE_SPELLINGS for n in pair)
    given = [n for n in names if getattr(req, n) is not None]
    for first, second in SCORE_SPELLINGS:
        if set(given) == {first, second}:
            return (first, getattr(req, first)), (second, getattr(req, second))
    spellings = ", ".join(f"{a} and {b}" for a, b in SCORE_SPELLINGS)
    if not given:
        param = "queries"
    elif len(given) == 1:  # the partner it lacks
        param = next(b if a in given else a for a, b in SCORE_SPELLINGS if given[0] in (a, b))
    else:  # a mix of spellings
        param = given[-1]
    raise APIError(400, f"give the texts to score as one pair of fields ({spellings}); got "
                        f"{', '.join(given) if given else 'none of them'}", param)


def _pairs(side_1: tuple[str, ScoreSide], side_2: tuple[str, ScoreSide]
           ) -> list[tuple[str, str]]:
    """1:1, 1:N (one query, many documents) or N:N (pairwise)."""
    (name_1, text_1), (name_2, text_2) = side_1, side_2
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise APIError(400, f"{name_1} and {name_2} must be non-empty",
                       name_1 if not first else name_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise APIError(400, f"{name_1} has {len(first)} items and {name_2} {len(second)}: "
                            f"give one {name_1}, or as many as {name_2}", name_2)
    if len(second) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} pairs in one request", name_2)
    return list(zip(first, second))


async def score_pairs(ctx: ServingContext, tag: RequestTag, pairs: list[tuple[str, str]],
                      truncate: int | None, activation: bool = True
                      ) -> tuple[list[float], int]:
    """A relevance score per pair and the tokens read: a cross-encoder's output on the pair,
    or the cosine similarity of the two embeddings."""
    info = pooling_info(ctx)
    if info.cross_encoder:
        if info.num_labels != 1:
            raise APIError(400, f"scoring needs a one-label classifier (this one has "
                                f"{info.num_labels})", "model")
        tok = ctx.engine.tokenizer
        limit = info.max_model_len

        def pair_builder(a: str, b: str) -> Callable[[], PromptInput]:
            def build() -> PromptInput:  # on a worker
                if info.pairs_as_text:  # an LLM reranker's prompt: cut only when asked
                    enc = tok.hf(a + b)
                else:
                    enc = tok.hf(a, b, truncation=True, max_length=limit)
                types = enc.get("token_type_ids")
                return PromptInput(list(enc["input_ids"]), PoolingParams(
                    PoolingTask.SCORE, truncate_prompt_tokens=truncate, activation=activation,
                    token_type_ids=tuple(types) if types is not None else None))
            return build

        outputs = await _pool(ctx, tag, [pair_builder(a, b) for a, b in pairs])
        return [o.data[0] for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
    params = PoolingParams(PoolingTask.EMBED, normalize=True, truncate_prompt_tokens=truncate)
    texts = sorted({t for pair in pairs for t in pair})  # each distinct text embedded once
    outputs = await _pool(ctx, tag, [_given(t, params) for t in texts])
    vectors = dict(zip(texts, (o.data for o in outputs)))
    scores = [math.fsum(x * y for x, y in zip(vectors[a], vectors[b])) for a, b in pairs]
    return scores, sum(len(o.prompt_token_ids) for o in outputs)


async def create_score(ctx: ServingContext, req: ScoreRequest, tag: RequestTag) -> Response:
    pooling_info(ctx)
    check_model(ctx, req.model)
    reject_unsupported(req)
    scores, tokens = await score_pairs(ctx, tag, _pairs(*_score_sides(req)),
                                       req.truncate_prompt_tokens,
                                       req.use_activation is not False)
    return JSONBytes(ScoreResponse(
        id=f"score-{tag.request_id}", model=ctx.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
    ).model_dump_json().encode())


async def create_rerank(ctx: ServingContext, req: RerankRequest, tag: RequestTag) -> Response:
    pooling_info(ctx)
    check_model(ctx, req.model)
    reject_unsupported(req)
    if not req.documents:
        raise APIError(400, "documents must be non-empty", "documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(400, "top_n must be >= 0", "top_n")
    scores, tokens = await score_pairs(ctx, tag, [(req.query, d) for d in req.documents],
                                       req.truncate_prompt_tokens,
                                       req.use_activation is not False)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i])
                            if req.return_documents else None) for i in order]
    return JSONBytes(dumps(RerankResponse(
        id=f"rerank-{tag.request_id}", model=ctx.model_name,
        usage=RerankUsage(total_tokens=tokens), results=results
    ).model_dump(exclude_none=True)).encode())
