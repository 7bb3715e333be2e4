"""What leaves the engine: per-request outputs (cumulative plus the last step's delta)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token and of the top alternatives at that step."""

    token_id: int
    logprob: float
    # (token_id, logprob) best first; len == SamplingParams.logprobs
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``text``/``token_ids``/``logprobs`` are cumulative; the ``delta_*`` fields hold what this
    step added, which is what a streaming client needs. Text that might still turn out to be
    the start of a stop string is held back until it can't be.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # the stop string or stop token id that ended it (None for EOS / length)
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """Everything a caller learns about one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Set when the request ended because of a fault in its own processing (the engine
    # logged the traceback); its completions then end with finish_reason "abort".
    error: str | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
