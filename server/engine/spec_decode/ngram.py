"""Prompt lookup (vLLM's ``ngram`` method): the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n that occurs."""

from __future__ import annotations

from array import array

from server.config import SpeculativeSettings
from server.engine.core.sequence import Sequence


class NgramProposer:
    """Drafts up to ``num_speculative_tokens`` tokens per sequence from its own prompt and
    output. The search is ``bytes.rfind`` over the token ids packed as 4-byte integers: a C
    scan per n-gram size, no Python loop over the context."""

    def __init__(self, settings: SpeculativeSettings) -> None:
        self.k = settings.num_speculative_tokens
        self.min_n = settings.prompt_lookup_min
        self.max_n = settings.prompt_lookup_max

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Each sequence's drafts (the scheduler's batched interface)."""
        return [self.propose(seq, limit) if limit > 0 else []
                for seq, limit in zip(seqs, limits)]

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """At most ``min(k, limit)`` draft tokens for ``seq`` (empty: no match)."""
        limit = min(self.k, limit)
        tokens = seq.all_token_ids
        num = len(tokens)
        if limit <= 0 or num < self.min_n + 1:
            return []
        packed = array("i", tokens).tobytes()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = packed[(num - n) * 4:]
            # the latest match with ``limit`` tokens after it (a match overlapping the end,
            # as in a repeating run, would leave fewer), else with at least one
            for follow in dict.fromkeys((limit, 1)):
                start = _rfind(packed, pattern, num - follow)
                if start >= 0:
                    return tokens[start + n:start + n + limit]
        return []


def _rfind(packed: bytes, pattern: bytes, end: int) -> int:
    """The token index of the latest token-aligned ``pattern`` ending by token ``end``."""
    end *= 4
    while True:
        at = packed.rfind(pattern, 0, end)
        if at < 0 or at % 4 == 0:
            return at // 4 if at >= 0 else -1
        end = at + len(pattern) - 1
