"""What leaves the engine: per-request outputs, as deltas of each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]

# Distinct buckets a request remembers (a trace attribute): eager steps run in exact shapes,
# a new one nearly every decode step, so the list is capped; the first ones are kept.
MAX_REQUEST_BUCKETS = 16


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token and of the top alternatives at that step."""

    token_id: int
    logprob: float
    # (token_id, logprob) best first; len == SamplingParams.logprobs
    top: list[tuple[int, float]] = field(default_factory=list)
    # 1 + how many tokens were likelier (prompt logprobs report it, as vLLM does)
    rank: int | None = None


# A prompt's logprobs, one per prompt token: None for the first (nothing predicts it)
PromptLogprobs = list["TokenLogprob | None"]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    In the outputs of an engine step, ``text`` / ``token_ids`` / ``logprobs`` hold what that
    step added (a streaming client's delta); :meth:`RequestOutput.add` accumulates them into
    the whole completion. Text that might still turn out to be the start of a stop string
    is held back until it can't be.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # the stop string or stop token id that ended it (None for EOS / length)
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Appends a later step's delta of the same completion."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # prompt tokens found in the prefix cache when it was first scheduled (usage's
    # prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # the distinct buckets its steps ran in ("phase:batch,query,blocks"), first seen first;
    # a tuple: outputs share it with the engine thread, which replaces rather than mutates
    buckets: tuple[str, ...] = ()

    def ran_in(self, bucket: str) -> None:
        """Records the bucket of a step the request took part in."""
        if bucket and bucket not in self.buckets and len(self.buckets) < MAX_REQUEST_BUCKETS:
            self.buckets += (bucket,)


@dataclass(slots=True)
class RequestOutput:
    """What a caller learns about one request after an engine step: each completion's delta
    (every completion is listed, with an empty delta where it did not advance)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Tokens generated so far over all completions (for usage; not a delta).
    num_generated_tokens: int = 0
    # Set when the request ended because of a fault in its own processing (the engine
    # logged the traceback); its completions then end with finish_reason "abort".
    error: str | None = None
    # with SamplingParams.prompt_logprobs: the whole prompt's, in the first output only
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, later: RequestOutput) -> None:
        """Accumulates a later step's output of the same request (what non-streaming
        callers do): texts and token lists grow, the rest is replaced."""
        for completion, delta in zip(self.outputs, later.outputs):
            completion.add(delta)
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_generated_tokens = later.num_generated_tokens
        self.error = later.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine for metrics and health reporting (a leaf type: the API reads
    it without importing the engine core, and so without torch)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # of which found cached
    # --enable-lora (vLLM's lora_requests_info): adapter names running / waiting, slots
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    # --speculative-config (cumulative; per_pos empty when speculation is off)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # --enable-sleep-mode: the level of the sleep not yet wholly undone (0: awake); a wake
    # that restores only some tags leaves it as it was, as /is_sleeping stays true
    sleep_level: int = 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step of the model runner hands back: one sampled token per scheduled
    sequence, in batch order (a leaf type: the output processor reads it without the
    runner)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # the step's bucket, "phase:batch,query,blocks" (the padded shape it ran in)
    bucket: str = ""
    # prompt logprobs computed this step: request id -> (index of the first prompt token
    # they score, one entry per token from there)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    # a speculative verify step: each row's run of tokens (accepted drafts, then the
    # corrected or bonus token; ``token_ids`` holds their first) and their logprobs
    runs: list[list[int]] | None = None
    run_logprobs: list[list[TokenLogprob | None]] | None = None

    @property
    def num_accepted(self) -> list[int]:
        """Draft tokens accepted per row (0 for a plain step)."""
        return [len(run) - 1 for run in self.runs] if self.runs is not None else [
            0] * len(self.token_ids)
