"""What a pooling request asks for, and what the API must know about the served pooling model.

A leaf module (no torch): the API imports it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class PoolingTask(str, enum.Enum):
    """What a pooling request computes (vLLM's task names)."""

    EMBED = "embed"  # one vector per input (normalized as the model says)
    CLASSIFY = "classify"  # class probabilities from the model's head
    SCORE = "score"  # one relevance score per (query, document) pair: the head's output

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """Per-request pooling settings (vLLM's ``PoolingParams``)."""

    task: PoolingTask = PoolingTask.EMBED
    # Matryoshka: keep the first ``dimensions`` values (then normalize again)
    dimensions: int | None = None
    # None: as the model says (a sentence-transformers Normalize module; on otherwise)
    normalize: bool | None = None
    # keep only the last N prompt tokens (-1: as many as the model takes)
    truncate_prompt_tokens: int | None = None
    # BERT's segment ids of a (text_1, text_2) pair, one per prompt token
    token_type_ids: tuple[int, ...] | None = None
    # the score of a one-label head through a sigmoid (CrossEncoder's default); False: raw
    activation: bool = True


@dataclass(frozen=True, slots=True)
class PoolingModelInfo:
    """The served pooling model, as the endpoints need to know it."""

    tasks: frozenset[PoolingTask]
    hidden_size: int
    num_labels: int
    # None: not a Matryoshka model (``dimensions`` is refused); empty: any size
    matryoshka_dimensions: tuple[int, ...] | None
    max_model_len: int
    # a classifier reads (text_1, text_2) pairs as one input (a cross-encoder)
    cross_encoder: bool
    # a cross-encoder pair is tokenized as the one text text_1 + text_2 (an LLM reranker,
    # whose prompt template the two texts spell out), not as a pair with separators
    pairs_as_text: bool = False
    # the sentence-transformers folder's named prompts
    prompts: dict[str, str] = field(default_factory=dict)
    id2label: dict[int, str] = field(default_factory=dict)
