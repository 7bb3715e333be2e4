"""Per-sequence state and the batch plan that crosses scheduler -> model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from server.engine.outputs import FinishReason, TokenLogprob
from server.engine.sampling_params import SamplingParams
from server.hpu.types import Phase


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One completion being generated: token ids, KV block table and stop state.

    A request with ``n`` completions owns ``n`` sequences (``index`` 0..n-1). The KV cache
    holds every token but the last one once the sequence has run; the last token is the
    input of the next decode step.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    output_logprobs: list[TokenLogprob] | None = None
    num_preemptions: int = 0
    # Per-sequence torch.Generator for seeded sampling, created lazily by the sampler; kept
    # here (typed Any) so scheduling code stays torch-free and the RNG survives preemption.
    generator: Any = None
    # Its structured-outputs matcher (engine.structured_outputs.GrammarState), if any.
    grammar: Any = None
    # Prefix caching: the names of its full blocks, and how many leading tokens its last
    # allocation found cached (the prefill computes the rest)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True)
class ScheduledBatch:
    """One engine step's plan: which sequences run, and in which phase.

    Prefill runs every token of each sequence (prompt plus, after a preemption, what it had
    generated) and samples one token; decode feeds each sequence's last token.
    """

    phase: Phase
    seqs: list[Sequence]
    # sequences pushed back to the waiting queue this step to free KV blocks
    preempted: list[Sequence] = field(default_factory=list)
