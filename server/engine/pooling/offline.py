"""The offline pooling API behind ``LLM.embed`` / ``LLM.classify`` / ``LLM.score``, with
vLLM's output shapes (``out.outputs.embedding``, ``.probs``, ``.score``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from server.engine.errors import RequestFailedError
from server.engine.pooling.engine import PoolingEngine
from server.engine.pooling.outputs import PoolingRequestOutput
from server.engine.pooling.params import PoolingParams, PoolingTask

T = TypeVar("T")
Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True, slots=True)
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True, slots=True)
class PoolingOutputs(Generic[T]):
    """One input's result (vLLM's ``EmbeddingRequestOutput`` and its kin)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: T
    finished: bool = True


_ids = itertools.count()


def run(engine: PoolingEngine, inputs: Sequence[tuple[Prompt, PoolingParams]]
        ) -> list[PoolingRequestOutput]:
    """Every input through the engine's batches; results in input order."""
    ids = []
    for prompt, params in inputs:
        request_id = f"offline-pool-{next(_ids)}"
        engine.enqueue(engine.prepare(request_id, prompt, params))
        ids.append(request_id)
    results: dict[str, PoolingRequestOutput] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise RequestFailedError(out.request_id, out.error)
                results[out.request_id] = out
    finally:
        for request_id in ids:
            if request_id not in results:
                engine.abort_request(request_id)
    return [results[r] for r in ids]


def _prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def embed(engine: PoolingEngine, prompts: Prompt | Sequence[Prompt],
          params: PoolingParams | None = None) -> list[PoolingOutputs[EmbeddingOutput]]:
    params = params or PoolingParams(PoolingTask.EMBED)
    outs = run(engine, [(p, params) for p in _prompts(prompts)])
    return [PoolingOutputs(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.data))
            for o in outs]


def classify(engine: PoolingEngine, prompts: Prompt | Sequence[Prompt]
             ) -> list[PoolingOutputs[ClassificationOutput]]:
    params = PoolingParams(PoolingTask.CLASSIFY)
    outs = run(engine, [(p, params) for p in _prompts(prompts)])
    return [PoolingOutputs(o.request_id, o.prompt_token_ids, ClassificationOutput(o.data))
            for o in outs]


def score(engine: PoolingEngine, data_1: str | Sequence[str], data_2: str | Sequence[str]
          ) -> list[PoolingOutputs[ScoringOutput]]:
    """``data_1`` against ``data_2`` (1:1, 1:N or N:N): a cross-encoder's score of each pair,
    or the cosine similarity of the two embeddings."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second) or not second:
        raise ValueError(f"{len(first)} data_1 items for {len(second)} data_2 items: give one "
                         "data_1, or as many as data_2")
    if engine.info.cross_encoder:
        inputs = []
        for a, b in zip(first, second):
            ids, types = engine.pair_tokens(a, b)
            inputs.append((ids, PoolingParams(PoolingTask.SCORE, token_type_ids=types)))
        outs = run(engine, inputs)
        return [PoolingOutputs(o.request_id, o.prompt_token_ids, ScoringOutput(o.data[0]))
                for o in outs]
    params = PoolingParams(PoolingTask.EMBED, normalize=True)
    left = run(engine, [(t, params) for t in first])
    right = run(engine, [(t, params) for t in second])
    return [PoolingOutputs(b.request_id, a.prompt_token_ids + b.prompt_token_ids,
                           ScoringOutput(math.fsum(x * y for x, y in zip(a.data, b.data))))
            for a, b in zip(left, right)]
