"""Per-sequence state and the batch plan that crosses scheduler -> model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from server.engine.lora.request import LoRARequest
from server.engine.multimodal.inputs import ImageSpan
from server.engine.outputs import FinishReason, TokenLogprob
from server.engine.sampling_params import SamplingParams
from server.hpu.types import Phase


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation of a request: token ids, KV block table and stop state. Inside the
    engine a generation is a sequence (the API's choice, vLLM's ``CompletionOutput``).

    A request with ``n`` generations owns ``n`` sequences (``index`` 0..n-1). The KV cache
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
    # Tokens whose K/V are in the cache: the next prefill chunk starts here (a cached
    # prefix counts; so do the earlier chunks of a chunked prompt)
    num_computed_tokens: int = 0
    # Who sent it (the server's --fair-share key; "" offline): fair admission and preemption
    client: str = ""
    # the adapter it runs with (--enable-lora; None: the base model)
    lora: LoRARequest | None = None
    # hybrid models: its slot in the state cache while it runs (server/engine/core/
    # state_cache.py); None while it waits
    state_slot: int | None = None
    # its prompt's images: where their placeholder tokens sit, their hashes and pixels
    images: tuple[ImageSpan, ...] = ()

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

    @property
    def in_prefill(self) -> bool:
        """Still computing its prompt (or, after a preemption, its recomputed tokens): it
        has not sampled since its last admission. Decoding means only the last token is
        left to compute."""
        return not self.output_token_ids or self.num_computed_tokens < self.num_tokens - 1


@dataclass(slots=True)
class ScheduledBatch:
    """One engine step's plan: which sequences run, and in which phase.

    Prefill computes each sequence's tokens from ``num_computed_tokens`` on (its prompt
    plus, after a preemption, what it had generated), all of them or, with chunked prefill,
    the next ``num_new_tokens``; a sequence samples one token once its last token is
    computed. Decode feeds each sequence's last token.
    """

    phase: Phase
    seqs: list[Sequence]
    # sequences pushed back to the waiting queue this step to free KV blocks
    preempted: list[Sequence] = field(default_factory=list)
    # prefill: tokens each sequence computes this step; None: all it has left
    num_new_tokens: list[int] | None = None
    # decode with speculation: each row's draft tokens, verified after its last token (a
    # verify step); None: a plain decode
    spec_token_ids: list[list[int]] | None = None

    def new_tokens(self, row: int) -> int:
        """Tokens row ``row`` computes this step."""
        if self.phase is Phase.DECODE:
            return 1 + (len(self.spec_token_ids[row]) if self.spec_token_ids else 0)
        if self.num_new_tokens is not None:
            return self.num_new_tokens[row]
        seq = self.seqs[row]
        return seq.num_tokens - seq.num_computed_tokens

    @property
    def sampling_rows(self) -> list[int]:
        """Rows that sample a token this step: every decode, and the prefills whose chunk
        reaches their last token."""
        if self.phase is Phase.DECODE:
            return list(range(len(self.seqs)))
        return [row for row, seq in enumerate(self.seqs)
                if seq.num_computed_tokens + self.new_tokens(row) == seq.num_tokens]

    def subset(self, seqs: list[Sequence]) -> ScheduledBatch:
        """The same step restricted to ``seqs`` (each keeps its chunk)."""
        if self.num_new_tokens is None:
            chunks = None
        else:
            chunk_of = {id(seq): n for seq, n in zip(self.seqs, self.num_new_tokens)}
            chunks = [chunk_of[id(seq)] for seq in seqs]
        spec = None
        if self.spec_token_ids is not None:
            drafts_of = {id(seq): d for seq, d in zip(self.seqs, self.spec_token_ids)}
            spec = [drafts_of[id(seq)] for seq in seqs]
        return ScheduledBatch(self.phase, list(seqs), [], chunks, spec)
