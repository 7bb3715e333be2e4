"""OpenAI's batch file format as vLLM's ``run-batch`` reads and writes it.

A request line: ``{"custom_id", "method", "url", "body"}``. An answer line: ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``; a request the
server refused has ``body`` null and the server's error body under ``error``.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# the routes a batch line may name: every POST endpoint whose answer is one JSON body
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
              "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
              "/v2/rerank")


class BatchFileError(ValueError):
    """The batch file itself is malformed (the whole run fails, as in vLLM)."""


class BatchRequestInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: str = "POST"
    url: str
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int = 200
    request_id: str = Field(default_factory=lambda: f"vllm-batch-{uuid.uuid4().hex}")
    body: Any | None = None


class BatchRequestOutput(BaseModel):
    id: str = Field(default_factory=lambda: f"vllm-{uuid.uuid4().hex}")
    custom_id: str
    response: BatchResponseData | None
    error: Any | None = None


def read_batch(text: str) -> list[BatchRequestInput]:
    """Every request of a batch file (blank lines skipped); a BatchFileError naming the
    first line that is no request."""
    requests = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(BatchRequestInput.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the line"
            raise BatchFileError(f"line {number} of the batch file is no batch request: "
                                 f"{where}: {first['msg']}") from None
    return requests


def refused(request: BatchRequestInput, status: int, error: Any,
            request_id: str | None = None) -> BatchRequestOutput:
    """The answer line of a request that got no answer body."""
    data = BatchResponseData(status_code=status)
    if request_id:
        data.request_id = request_id
    return BatchRequestOutput(custom_id=request.custom_id, response=data, error=error)


def answered(request: BatchRequestInput, body: Any, request_id: str) -> BatchRequestOutput:
    return BatchRequestOutput(custom_id=request.custom_id,
                              response=BatchResponseData(body=body, request_id=request_id))
