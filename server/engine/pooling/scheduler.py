"""Which waiting pooling requests run together: first come first served, as many as one
planned bucket holds within the step's token budget. There is no decode phase and no KV
cache: a request is scheduled once and is done."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from server.engine.pooling.params import PoolingParams
from server.hpu.types import Bucket


@dataclass(slots=True)
class PoolingRequest:
    """A prepared pooling request (tokenized and checked, off the engine thread)."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    arrival_time: float
    client: str = ""
    metrics: object | None = field(default=None)


class BucketFit(Protocol):
    def __call__(self, rows: int, length: int) -> Bucket | None: ...


class PoolingScheduler:
    """Waiting requests in arrival order; ``schedule`` takes the longest prefix of them
    whose padded batch fits a planned bucket of at most ``max_num_batched_tokens`` tokens."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 bucket_for: BucketFit) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.bucket_for = bucket_for
        self.waiting: OrderedDict[str, PoolingRequest] = OrderedDict()
        self.num_running = 0

    def add(self, request: PoolingRequest) -> None:
        self.waiting[request.request_id] = request

    def abort(self, request_id: str) -> PoolingRequest | None:
        return self.waiting.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> list[PoolingRequest]:
        """The next batch (removed from the queue); empty when nothing waits."""
        batch: list[PoolingRequest] = []
        longest = 0
        for request in self.waiting.values():
            length = max(longest, len(request.token_ids))
            bucket = self.bucket_for(len(batch) + 1, length)
            fits = (len(batch) < self.max_num_seqs and bucket is not None
                    and bucket.batch * bucket.query <= self.max_num_batched_tokens)
            if batch and not fits:
                break
            batch.append(request)  # the first request always runs (alone if need be)
            longest = length
        for request in batch:
            del self.waiting[request.request_id]
        return batch
