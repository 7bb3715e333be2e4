"""Batch limits: the scheduler's flags, and the limits resolved from them once the model is known."""

from __future__ import annotations

from dataclasses import dataclass

from server.config.fields import derived, flag

# The step's token budget when --max-num-batched-tokens is unset: with chunked prefill the
# whole budget; without, the floor (every prompt fits whole; short contexts still batch a few).
MIN_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits. ``None`` fields are derived from the model once it is loaded."""

    max_num_seqs: int = flag(256, help="sequences in one step's batch")
    max_num_batched_tokens: int | None = flag(
        None, help="tokens one step computes (default with chunked prefill: 512 on CPU, 2048 "
                   "on accelerators; else max(--max-model-len, 2048))")
    max_model_len: int | None = flag(None, help="context length (serve: the model's when unset)")
    policy: str = flag("fcfs", name="scheduling-policy", choices=("fcfs", "priority"),
                       help="fcfs: arrival order; priority: the request field priority (lower "
                            "first, ties by arrival), lowest priority preempted first")
    enable_chunked_prefill: bool = flag(
        True, help="split long prompts over steps within --max-num-batched-tokens, running "
                   "decodes first in every step (with graphs, a chunk after the first runs "
                   "alone in a prompt bucket with context blocks)")
    fair_share: bool = derived(
        False, help="admission round-robins over clients' waiting queues, and a client "
                    "holding more than its share of the batch is preempted first when another "
                    "client waits: set by --fair-share other than off")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError("--scheduling-policy must be fcfs or priority")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")

    def batched_tokens_for(self, max_model_len: int, chunked: bool = False,
                           default_max_num_batched_tokens: int = MIN_BATCHED_TOKENS) -> int:
        """The step's token budget once ``max_model_len`` is known: with chunked prefill a
        fixed default, the platform's (prompts longer than it take several steps),
        otherwise at least one whole prompt of the longest kind."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return (default_max_num_batched_tokens if chunked
                else max(max_model_len, MIN_BATCHED_TOKENS))


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    """Resolved batch limits (no ``None``: the model is known by now), resolved once per
    rank by ``server.engine.worker.builder.resolve_limits`` and passed around from there."""

    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget
    max_model_len: int
    policy: str = "fcfs"
    # prompts split over steps under the token budget, decodes first (mixed steps)
    chunked_prefill: bool = False
    # static shapes: a prefill after a context (cached prefix, earlier chunks) runs as its
    # own batch, as the prompt buckets with context blocks have batch size 1
    context_prefill_alone: bool = False
    # admission round-robins over clients (Sequence.client); see Scheduler
    fair_share: bool = False

    @classmethod
    def resolve(cls, config: SchedulerConfig, model_max_len: int,
                chunked_prefill: bool | None = None,
                context_prefill_alone: bool = False,
                default_max_num_batched_tokens: int = MIN_BATCHED_TOKENS) -> SchedulerLimits:
        """The flags' limits with the model's defaults filled in, checked against it.
        ``chunked_prefill`` overrides the flag; ``default_max_num_batched_tokens``: the
        platform's step budget with chunked prefill when ``--max-num-batched-tokens`` is
        unset."""
        chunked = config.enable_chunked_prefill if chunked_prefill is None else chunked_prefill
        max_model_len = config.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"{model_max_len}")
        max_num_batched_tokens = config.batched_tokens_for(max_model_len, chunked,
                                                           default_max_num_batched_tokens)
        if max_num_batched_tokens < max_model_len and not chunked:
            # Without chunked prefill a whole prompt must fit one step's token budget.
            raise ValueError(
                f"--max-num-batched-tokens ({max_num_batched_tokens}) must be >= "
                f"--max-model-len ({max_model_len}) since prompts are not chunked "
                "(--no-enable-chunked-prefill)")
        return cls(config.max_num_seqs, max_num_batched_tokens, max_model_len, config.policy,
                   chunked, context_prefill_alone, config.fair_share)
