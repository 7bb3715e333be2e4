"""Wire schemas of the pooling endpoints (pydantic only), as vLLM and OpenAI spell them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from server.api.protocol import ChatMessage, OpenAIModel, RequestModel, now
from server.api.text_fields import Text, no_bool_token_ids

TokenIds = Annotated[list[int], BeforeValidator(no_bool_token_ids)]
# a string, a list of strings, a list of token ids or a list of such lists (OpenAI's input)
PoolingInput = Text | list[Text] | TokenIds | list[TokenIds]


class EmbeddingRequest(RequestModel):
    """``/v1/embeddings`` and ``/pooling``: ``input``, or chat-style ``messages`` (vLLM's
    chat embedding request, rendered with the model's chat template)."""

    model: Text | None = None
    input: PoolingInput | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    # vLLM's newer spelling of normalize (for an embedding, the activation is the norm)
    use_activation: bool | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ClassificationRequest(RequestModel):
    model: Text | None = None
    input: PoolingInput | None = None
    user: Text | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # false: the head's raw logits


ScoreSide = Text | list[Text]


class ScoreRequest(RequestModel):
    """One side against the other: one to one, one to many, or pairwise (N to N). The sides
    come under one of vLLM's spellings (``SCORE_SPELLINGS``); which one is checked where the
    request is served, so that the 400 names the fields the client sent."""

    model: Text | None = None
    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # false: a cross-encoder's raw logit


# vLLM's names for the two sides of /score, newest first (text_1 / text_2 is the oldest)
SCORE_SPELLINGS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class RerankRequest(RequestModel):
    """Jina / Cohere's rerank: ``documents`` ordered by relevance to ``query``."""

    model: Text | None = None
    query: Text
    documents: list[Text]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None


class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# bodies the routes parse on a worker (for the OpenAPI document's components)
BODIES: tuple[type[BaseModel], ...] = (EmbeddingRequest, ClassificationRequest, ScoreRequest,
                                       RerankRequest)
