"""Acceptance counters of speculative decoding (vLLM's ``vllm:spec_decode_*`` series)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative over the engine's life: verify steps' drafts (one per sequence that had
    draft tokens), their tokens, the tokens accepted, and acceptances per draft position."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, drafts: list[list[int]], accepted: list[int]) -> None:
        """One verify step: each row's drafts and how many of them were accepted."""
        for extra, num in zip(drafts, accepted):
            if not extra:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += len(extra)
            self.num_accepted_tokens += num
            for pos in range(num):
                self.accepted_per_pos[pos] += 1
